"""The default policy table: every primitive classified, every name resolved.

The table lists primitives by name; `jaxamp.transform._rules` resolves the names against
the running JAX. A name that resolves to nothing, or a primitive of JAX's lax
package with no entry, would silently run at original precision through
``amp_default``: both fail here. Then the primitives whose classification is
not obvious, run the way a real program meets them: checkpoint names, a
tensor-parallel layer's collectives, the fused derivatives of JAX 0.11.2+,
ragged (grouped) matmuls, and primitives deliberately kept at original
precision. amp's fallback warnings fail every test of this module.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp import _compat
from jaxamp.transform import _interpreter, _rules

from jax_catalogue import lax_primitives_by_name
from jaxpr_walk import assert_all_matmuls_in, float_operand_dtypes, iter_eqns

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
RNG = np.random.default_rng(0)

pytestmark = [
    pytest.mark.jax_internals,
    pytest.mark.filterwarnings("error:amp policy table:UserWarning"),
    pytest.mark.filterwarnings("error:jaxamp has no handler:UserWarning"),
    pytest.mark.usefixtures("fresh_warnings"),
]


def uniform(lo, hi, shape):
    return jnp.asarray(RNG.uniform(lo, hi, shape).astype(np.float32))


def operand_dtypes(jaxpr, name):
    """The floating operand dtypes of each `name` equation in `jaxpr`, nested ones included."""
    return [dtypes for _, dtypes in float_operand_dtypes(jaxpr, (name,))]


# --- names and classification --------------------------------------------------------------


def test_each_name_is_in_one_list():
    names = [n for names, _ in _rules._RULES_BY_NAME_LIST for n in names]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def _defined_on_this_release(first, stop):
    release = jax.__version_info__
    return (first is None or release >= first) and (stop is None or release < stop)


def test_every_listed_name_resolves_where_its_release_defines_it():
    """Names resolve on every release, release-specific ones exactly where their range says."""
    expected_missing = {
        name
        for name, (first, stop) in _rules._RELEASE_SPECIFIC_NAMES.items()
        if not _defined_on_this_release(first, stop)
    }
    assert sorted(_rules._unresolved_primitive_names()) == sorted(expected_missing)
    # Release-specific names are table names (a typo there would excuse nothing).
    assert set(_rules._RELEASE_SPECIFIC_NAMES) <= _rules._primitive_names()


def test_every_lax_primitive_has_an_entry_or_a_handler():
    table = jaxamp.default_amp_policy
    unclassified = sorted(
        name
        for name, primitive in lax_primitives_by_name().items()
        if primitive not in table and primitive not in _interpreter.HANDLERS
    )
    assert unclassified == []


# --- identities: checkpoint names ------------------------------------------------------------

W, X = uniform(-1, 1, (8, 8)) / 4, uniform(-1, 1, (4, 8))


def _named_layer(w, x):
    # A layer inside a model: its output feeds the next matmul (what follows
    # the last matmul is the program's tail, run in float32).
    h = checkpoint_name(x @ w, "h")
    return jnp.sum(jnp.tanh(h) @ w.T)


@pytest.mark.newest_only
def test_checkpoint_name_keeps_the_compute_dtype():
    jaxpr = jax.make_jaxpr(jaxamp.amp(_named_layer, compute_dtype="bf16"))(W, X)
    assert operand_dtypes(jaxpr, "name") == [(BF16,)]


@pytest.mark.parametrize("amp_outside", [True, False], ids=["amp(checkpoint)", "checkpoint(amp)"])
@pytest.mark.newest_only
def test_remat_policy_saves_named_values_in_compute_dtype(amp_outside):
    """save_only_these_names saves the named bf16 value, not a float32 copy of it."""
    policy = jax.checkpoint_policies.save_only_these_names("h")
    if amp_outside:
        fn = jaxamp.amp(jax.checkpoint(_named_layer, policy=policy), compute_dtype="bf16")
    else:
        fn = jax.checkpoint(jaxamp.amp(_named_layer, compute_dtype="bf16"), policy=policy)
    # The only residual that is not an argument is the named value. (JAX 0.10.0
    # describes it as "output of reduce_precision", later releases as "named 'h'".)
    saved = [aval for aval, where in _compat.saved_residuals(fn, W, X) if "argument" not in where]
    assert [(a.dtype, a.shape) for a in saved] == [(BF16, (4, 8))]


# --- collectives: a tensor-parallel layer ---------------------------------------------------


@pytest.mark.newest_only
def test_tensor_parallel_layer_stays_in_compute_dtype_across_its_all_reduce():
    """pvary, psum (psum_invariant inside shard_map) and what follows run in bf16."""
    mesh = jax.make_mesh((8,), ("tp",))
    d, hidden = 16, 64

    def layer(x, w_in, w_up, w_down):
        h = x @ w_in  # replicated weight: h is invariant across "tp"
        u = jnp.tanh(h @ w_up)  # column-parallel: JAX inserts pvary(h)
        return jnp.tanh(lax.psum(u @ w_down, "tp"))  # row-parallel, then all-reduce

    f = jax.shard_map(layer, mesh=mesh, in_specs=(P(), P(), P(None, "tp"), P("tp", None)), out_specs=P())
    x, w_in = uniform(-1, 1, (4, d)), uniform(-1, 1, (d, d)) / 4
    w_up = jax.device_put(uniform(-1, 1, (d, hidden)) / 4, NamedSharding(mesh, P(None, "tp")))
    w_down = jax.device_put(uniform(-1, 1, (hidden, d)) / 8, NamedSharding(mesh, P("tp", None)))
    amp_f = jaxamp.amp(f, compute_dtype="bf16")

    jaxpr = jax.make_jaxpr(amp_f)(x, w_in, w_up, w_down)
    assert operand_dtypes(jaxpr, "pvary") == [(BF16,)]
    assert operand_dtypes(jaxpr, "psum_invariant") + operand_dtypes(jaxpr, "psum") == [(BF16,)]
    assert operand_dtypes(jaxpr, "tanh") == [(BF16,), (BF16,)]
    assert_all_matmuls_in(jaxpr, BF16, at_least=3)
    # bf16 keeps 8 bits: a few roundings of values of order 1.
    np.testing.assert_allclose(jax.jit(amp_f)(x, w_in, w_up, w_down), f(x, w_in, w_up, w_down), atol=3e-2)


# --- derivatives JAX 0.11.2+ fuses ----------------------------------------------------------

_COEFFICIENTS = jnp.array([0.5, -1.0, 2.0])

# jnp function, input domain, and the dtype amp(jax.grad) runs each listed
# primitive in after a bf16 matmul. JAX 0.11.2+ computes 1 - x**2 (in the
# derivatives of tanh, asin, acos, atanh) as one_minus_square and log2 as one
# primitive, and 0.12 jnp.polyval's Horner's rule as polynomial; JAX 0.10 ran
# them as square (or integer_pow) and sub, log, and mul and add in a scan (the
# adds carry the value; 0.12 multiplies the coefficients, float32 scalars): in
# the dtypes listed beside them.
DERIVATIVES = {
    "tanh": (jnp.tanh, (-1, 1), {"tanh": BF16, "one_minus_square": BF16, "sub": BF16}),
    "asin": (jnp.arcsin, (-0.5, 0.5), {"one_minus_square": BF16, "square": BF16, "sub": BF16, "rsqrt": F32}),
    "acos": (jnp.arccos, (-0.5, 0.5), {"one_minus_square": BF16, "square": BF16, "sub": BF16, "rsqrt": F32}),
    "atanh": (jnp.arctanh, (-0.5, 0.5), {"one_minus_square": BF16, "integer_pow": BF16, "sub": BF16}),
    "log2": (lambda h: jnp.log2(h + 2.0), (-1, 1), {"add": BF16, "log2": F32, "log": F32}),
    "polyval": (lambda h: jnp.polyval(_COEFFICIENTS, h), (-1, 1), {"polynomial": BF16, "add": BF16}),
}
# What must appear where the running JAX defines it.
_FUSED = ("one_minus_square", "log2", "polynomial")


@pytest.mark.parametrize("name", DERIVATIVES)
def test_fused_derivatives_run_as_jax_0_10_ran_them(name):
    op, (lo, hi), expected = DERIVATIVES[name]

    def loss(w, x):
        return jnp.sum(op(x @ w))

    w, x = uniform(lo, hi, (4, 4)) / 4, uniform(lo, hi, (3, 4))
    jaxpr = jax.make_jaxpr(jaxamp.amp(jax.grad(loss), compute_dtype="bf16"))(w, x)
    found = {e.primitive.name for e in iter_eqns(jaxpr)}
    defined = _compat.primitives_by_name()
    assert not {p for p in _FUSED if p in expected and p in defined} - found
    wrong = {
        (p, dtypes) for p, dtype in expected.items() for dtypes in operand_dtypes(jaxpr, p) if set(dtypes) != {dtype}
    }
    assert wrong == set()


# --- ragged (grouped) matmuls -----------------------------------------------------------------

_M, _K, _N, _GROUPS = 6, 4, 5, np.array([2, 1, 3], np.int32)


def _ragged(lhs, rhs):
    return lax.ragged_dot(lhs, rhs, _GROUPS)


@pytest.mark.newest_only
def test_ragged_dot_runs_in_compute_dtype_forward_and_backward():
    lhs, rhs = uniform(-1, 1, (_M, _K)), uniform(-1, 1, (len(_GROUPS), _K, _N))

    def loss(lhs, rhs):
        return jnp.sum(jnp.tanh(_ragged(lhs, rhs)))

    grad = jax.grad(loss, argnums=(0, 1))
    jaxpr = jax.make_jaxpr(jaxamp.amp(grad, compute_dtype="bf16"))(lhs, rhs)
    # the forward product and the two transposed ones
    assert len(operand_dtypes(jaxpr, "ragged_dot_general")) == 3
    assert_all_matmuls_in(jaxpr, BF16, at_least=3)

    # Each output sums K=4 products of values in [-1, 1]: bf16's unit roundoff
    # 2**-8 per operand and per partial sum stays within 2e-2 of float32.
    out = jaxamp.amp(_ragged, compute_dtype="bf16")(lhs, rhs)
    assert out.dtype == F32
    np.testing.assert_allclose(out, _ragged(lhs, rhs), atol=2e-2)
    for got, want in zip(jaxamp.amp(grad, compute_dtype="bf16")(lhs, rhs), grad(lhs, rhs)):
        assert got.dtype == F32
        np.testing.assert_allclose(got, want, atol=2e-2 * len(_GROUPS))


def test_explain_counts_ragged_dot_flops_as_a_matmul():
    lhs, rhs = uniform(-1, 1, (_M, _K)), uniform(-1, 1, (len(_GROUPS), _K, _N))
    report = jaxamp.explain(_ragged, compute_dtype="bf16")(lhs, rhs)
    assert report.total_matmul_flops == 2 * _M * _K * _N
    assert report.low_precision_flop_fraction == 1.0


# --- deliberately original precision ------------------------------------------------------------


def _after_matmul(op):
    return lambda w, x: op(x @ w)


def _host_double(a):
    return np.asarray(a) * 2


def _double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


ORIGINAL_PRECISION = {
    "pure_callback": lambda y: jax.pure_callback(_host_double, jax.ShapeDtypeStruct(y.shape, y.dtype), y),
    "io_callback": lambda y: io_callback(_host_double, jax.ShapeDtypeStruct(y.shape, y.dtype), y),
    "debug_callback": lambda y: (jax.debug.callback(_host_double, y), y)[1],
    # Traced only: no such FFI target is registered.
    "ffi_call": lambda y: jax.ffi.ffi_call("jaxamp_test_target", jax.ShapeDtypeStruct(y.shape, y.dtype))(y),
    "pallas_call": lambda y: pl.pallas_call(
        _double_kernel, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), interpret=True
    )(y),
    "bitcast_convert_type": lambda y: lax.bitcast_convert_type(y, jnp.int32),
    "fft": lambda y: jnp.fft.rfft(y),
    "eigh": lambda y: jnp.linalg.eigh(y @ y.T + 4 * jnp.eye(y.shape[0]))[0],
    "conj": lax.conj,
    "complex": lambda y: lax.complex(y, y),
    "nextafter": lambda y: lax.nextafter(y, jnp.zeros_like(y)),
}


@pytest.mark.parametrize("name", ORIGINAL_PRECISION)
@pytest.mark.newest_only
def test_kept_primitives_get_float32_after_a_half_matmul_and_amp_says_nothing(name):
    """Callbacks, kernels, FFT, linear algebra, bitcasts and float32-only ops see float32, silently."""
    fn = _after_matmul(ORIGINAL_PRECISION[name])
    jaxpr = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype="bf16"))(W, X)
    dtypes = operand_dtypes(jaxpr, name)
    assert dtypes and all(set(d) == {F32} for d in dtypes)
