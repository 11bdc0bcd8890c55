"""amp on flax nnx modules that set attributes while called (a `functools.cached_property`).

A model that builds a table on its first call (a RoPE table, say) writes it
into the instance's ``__dict__``: flax 0.12.6 and later count it a static
attribute (0.12.3 an array state leaf), not a Variable. amp runs the call on
copies inside its trace, and must leave the caller's module as a plain call
leaves it: the table set, a concrete array, eagerly and under
`nnx.value_and_grad`; under `nnx.jit` whatever flax itself leaves there (flax
0.12.12 leaves the jit's tracer, as it does without amp). Attributes it cannot
carry back are errors naming their path.

Tolerances: one bfloat16 matmul (K = 16 terms of unit scale) then float32
elementwise work. Measured against float32 over three seeds: outputs within
0.6% of the largest output, gradients within 0.5% of the largest gradient
(float16 under a loss scale: 0.01%). Hence 2% of the largest value: a margin
of 3x or more.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

nnx = pytest.importorskip("flax.nnx")

import jaxamp  # noqa: E402

from jaxpr_walk import assert_all_matmuls_in  # noqa: E402

# Runs on the oldest supported JAX too (.ci/run): it touches flax's internals.
pytestmark = pytest.mark.jax_internals

TOLERANCE = 2e-2
BF16 = dict(compute_dtype="bf16")
X = jax.random.normal(jax.random.key(0), (4, 8, 16))


class Rope(nnx.Module):
    """A Linear, then rotary-style scaling by tables built on the first call."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)

    @functools.cached_property
    def rope(self):
        # Built with jnp: traced inside amp's trace (and a jit's), as in most models.
        positions = jnp.arange(8, dtype=jnp.float32)[:, None]
        inv_freq = 1.0 / 10000.0 ** (jnp.arange(16, dtype=jnp.float32) / 16)
        return jnp.cos(positions * inv_freq)

    @functools.cached_property
    def scale(self):
        return jnp.asarray(np.linspace(0.5, 1.5, 16, dtype=np.float32))  # a constant

    def __call__(self, x):
        return self.linear(x) * self.rope * self.scale


def loss(model, x):
    return jnp.mean(model(x) ** 2)


AMP_LOSS = jaxamp.amp(loss, **BF16)


def assert_close(got, want, what=""):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert [g.dtype for g in got] == [w.dtype for w in want], what
    scale = max(float(jnp.max(jnp.abs(w))) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE * scale, err_msg=what)


def left(model, name="rope"):
    """What a call left as the module's attribute `name`: absent, a tracer, or its value."""
    if name not in vars(model):
        return "absent"
    value = vars(model)[name]
    return "tracer" if isinstance(value, jax.core.Tracer) else np.asarray(value)


def assert_left_as(model, plain):
    for name in ("rope", "scale"):
        got, want = left(model, name), left(plain, name)
        if isinstance(want, str):
            assert isinstance(got, str) and got == want, (name, got, want)
        else:
            assert not isinstance(got, str), (name, got)
            assert got.dtype == np.float32, name  # the dtype fn itself computed it in
            np.testing.assert_array_equal(got, want, err_msg=name)


def bf16_matmuls(fn, model, *args, at_least=1):
    """The matmuls of ``fn(model, *args)``, traced from the module's state, are bfloat16."""
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda state, *args: fn(nnx.merge(graphdef, state), *args))(state, *args)
    assert_all_matmuls_in(jaxpr, jnp.bfloat16, at_least=at_least)


def test_eager_call_sets_the_table_on_the_callers_module():
    model, plain = Rope(nnx.Rngs(0)), Rope(nnx.Rngs(0))
    got = AMP_LOSS(model, X)
    assert_close(got, loss(plain, X))
    assert not isinstance(left(model), str)  # set, a concrete array
    assert_left_as(model, plain)
    assert_close(AMP_LOSS(model, X), loss(plain, X), "second call, the table already set")
    bf16_matmuls(AMP_LOSS, Rope(nnx.Rngs(0)), X)


def test_under_nnx_jit_amp_leaves_what_flax_leaves():
    # Each jit its own function: flax's own jit cache cannot compare graph
    # definitions that hold arrays (a second module through one nnx.jit'd
    # function raises, amp or not).
    model, plain = Rope(nnx.Rngs(0)), Rope(nnx.Rngs(0))
    got = nnx.jit(lambda m, x: AMP_LOSS(m, x))(model, X)
    want = nnx.jit(lambda m, x: loss(m, x))(plain, X)
    assert_close(got, want)
    assert_close(got, loss(Rope(nnx.Rngs(0)), X))
    assert_left_as(model, plain)
    # Filled by an eager call first (or built in __init__), the module runs
    # under nnx.jit again and again on every flax.
    model, plain = Rope(nnx.Rngs(0)), Rope(nnx.Rngs(0))
    AMP_LOSS(model, X)
    step = nnx.jit(AMP_LOSS)
    for _ in range(2):
        assert_close(step(model, X), loss(plain, X))
    assert not isinstance(left(model), str)


def test_value_and_grad_matches_float32_and_sets_the_table():
    model, plain = Rope(nnx.Rngs(0)), Rope(nnx.Rngs(0))
    value, grads = nnx.value_and_grad(AMP_LOSS)(model, X)
    want_value, want_grads = nnx.value_and_grad(loss)(plain, X)
    assert_close((value, grads), (want_value, want_grads))
    assert_left_as(model, plain)
    assert not isinstance(left(model), str)
    # Forward and backward: the forward matmul and the kernel's gradient (the
    # input's gradient is not needed).
    bf16_matmuls(lambda m, x: nnx.value_and_grad(AMP_LOSS)(m, x), Rope(nnx.Rngs(0)), X, at_least=2)


def test_amp_module_and_a_fresh_instance_restored_from_its_state():
    model = jaxamp.amp_module(Rope(nnx.Rngs(0)), **BF16)
    plain = Rope(nnx.Rngs(0))
    assert_close(model(X), plain(X))
    assert_left_as(model, plain)
    bf16_matmuls(lambda m, x: m(x), jaxamp.amp_module(Rope(nnx.Rngs(0)), **BF16), X)
    # A checkpoint restored into a new instance: its first call builds the table again.
    fresh = jaxamp.amp_module(Rope(nnx.Rngs(7)), **BF16)
    nnx.update(fresh, nnx.state(model, nnx.Param))
    assert_close(fresh(X), plain(X), "restored")
    assert_left_as(fresh, plain)
    # So does a new instance under plain amp.
    fresh = Rope(nnx.Rngs(7))
    nnx.update(fresh, nnx.state(plain, nnx.Param))
    assert_close(AMP_LOSS(fresh, X), loss(plain, X), "restored, amp")
    assert_left_as(fresh, plain)
    # A copy nnx.merge makes (a sampler's) has the table and runs amp.
    graphdef, state = nnx.split(model)
    assert_close(nnx.merge(graphdef, state)(X), plain(X), "merged copy")


def test_under_a_loss_scale_a_cache_is_kept_as_built():
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    model, plain = Rope(nnx.Rngs(0)), Rope(nnx.Rngs(0))
    opt_state = tx.init(nnx.state(model, nnx.Param))
    amp_loss = jaxamp.amp(loss, compute_dtype="f16", loss_scale=opt_state)
    value, grads = nnx.value_and_grad(amp_loss)(model, X)
    assert_close((value, grads), nnx.value_and_grad(loss)(plain, X))
    assert_left_as(model, plain)


class Counting(nnx.Module):
    """Counts its calls in a static int, keeps a table derived from its weights and its last output's mean."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)
        self.calls = 0

    @functools.cached_property
    def transposed(self):
        return self.linear.kernel[...].T  # computed from traced state

    def __call__(self, x):
        self.calls += 1
        out = x @ self.transposed.T
        self.last = out.mean()  # through flax's __setattr__: data (state) for an array, in a plain call
        return out


def test_static_attributes_and_values_traced_from_state_come_back_as_a_plain_call_leaves_them():
    model, plain = Counting(nnx.Rngs(0)), Counting(nnx.Rngs(0))
    got = jaxamp.amp(lambda m, x: m(x), **BF16)(model, X)
    assert_close(got, plain(X))
    assert model.calls == plain.calls == 1
    np.testing.assert_array_equal(left(model, "transposed"), left(plain, "transposed"))
    # The new array attribute is state, as flax marks it for the value a plain call sets.
    assert [path for path, _ in nnx.state(model).flat_state()] == [path for path, _ in nnx.state(plain).flat_state()]
    assert_close(model.last, plain.last, "last")


class Invalidating(Rope):
    """Drops its cached table at every call (as after a change of sequence length)."""

    def __call__(self, x):
        out = super().__call__(x)
        del self.__dict__["scale"]
        return out


def test_a_deleted_attribute_is_deleted_on_the_callers_module():
    model = Invalidating(nnx.Rngs(0))
    AMP_LOSS(model, X)
    assert "rope" in vars(model) and "scale" not in vars(model)


@dataclasses.dataclass
class Table:
    values: jax.Array  # a dataclass with __eq__: unhashable, not a pytree


class Opaque(Rope):
    @functools.cached_property
    def table(self):
        return Table(jnp.ones(16))

    def __call__(self, x):
        return super().__call__(x) * self.table.values


def test_an_attribute_amp_cannot_carry_is_an_error_naming_it_and_the_fix():
    model = Opaque(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"fn set model\.table to a Table .*__init__.*nnx\.Variable"):
        jaxamp.amp(lambda model, x: model(x).sum(), **BF16)(model, X)
    assert "table" not in vars(model)
    with pytest.raises(ValueError, match=r"fn set self\.table to a Table"):
        jaxamp.amp_module(Opaque(nnx.Rngs(0)), **BF16)(X)


class Retagging(Rope):
    def __call__(self, x):
        self.linear.kernel.set_metadata(tag="seen")
        return super().__call__(x)


def test_a_changed_variable_metadata_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match=r"changed the metadata of model\.linear\.kernel"):
        jaxamp.amp(lambda model, x: model(x).sum(), **BF16)(Retagging(nnx.Rngs(0)), X)
