"""Bad input to amp's public API: the right exception, early, naming the culprit.

`amp`'s arguments (the function, ``compute_dtype``, ``amp_policy``, ``policy``)
are checked when `amp` is called, before anything is traced, in the direct and
the decorator form alike. A policy rule's result is checked when the equation it
chose runs, and a malformed one is reported with the rule's name and the table
entry that chose it, also from inside jit and loop bodies. `amp_stop`,
`use_precision` and `parse_dtype` reject what they cannot use. Errors raised by
the user's function itself, or by JAX on it, reach the caller unchanged.

Loss scaling, policies and sharding have bad-input tests of their own; only the
`policy=` argument of `amp`, where the two APIs meet, is covered here.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp import Policy, amp, amp_stop, use_compute_precision, use_precision

X = jnp.ones((2, 2))


def _stable_id(value):
    # repr() without memory addresses, so that every pytest-xdist worker
    # collects the same test ids.
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def matmul(x):
    return x @ x


# --- the function ----------------------------------------------------------------------


@pytest.mark.parametrize("fn", [3, "matmul", [matmul], X, object()], ids=lambda fn: type(fn).__name__)
def test_non_callable_fn_is_a_type_error_naming_it(fn):
    with pytest.raises(TypeError, match=f"amp expects a callable.*got {type(fn).__name__}"):
        amp(fn)


def test_fn_none_is_the_decorator_form_not_an_error():
    decorator = amp(None, compute_dtype="bf16")
    assert decorator(matmul)(X).dtype == jnp.float32


# --- dtypes ----------------------------------------------------------------------------

# Where a compute dtype is accepted, and the name its errors give the argument.
DTYPE_ARGUMENTS = {
    "amp": (lambda dtype: amp(matmul, compute_dtype=dtype), "compute_dtype"),
    "amp_decorator": (lambda dtype: amp(compute_dtype=dtype), "compute_dtype"),
    "use_precision": (use_precision, "use_precision dtype"),
}

# (bad dtype, exception, how the message names it). Integers, booleans, float64
# and complex are real dtypes amp will not compute in: TypeError. Names that are
# no dtype at all: ValueError.
BAD_DTYPES = [
    (jnp.int32, TypeError, "int32"),
    ("int8", TypeError, "int8"),
    (np.dtype("uint8"), TypeError, "uint8"),
    (bool, TypeError, "bool"),
    (jnp.float64, TypeError, "float64"),
    ("f64", TypeError, "float64"),
    (np.float64, TypeError, "float64"),
    (jnp.complex64, TypeError, "complex64"),
    ("f17", ValueError, "'f17'"),
    ("float17", ValueError, "'float17'"),
    ("", ValueError, "''"),
    (None, TypeError, "None"),
    (3, TypeError, "got 3"),
    (object(), TypeError, "object object"),
]


@pytest.mark.parametrize("where", sorted(DTYPE_ARGUMENTS))
@pytest.mark.parametrize("dtype, error, name", BAD_DTYPES, ids=[_stable_id(d[0]) for d in BAD_DTYPES])
def test_bad_compute_dtype_names_argument_and_value(where, dtype, error, name):
    make, argument = DTYPE_ARGUMENTS[where]
    with pytest.raises(error) as info:
        make(dtype)
    assert argument in str(info.value)
    assert name in str(info.value)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (3, TypeError, "expects a string.*got 3"),
        (None, TypeError, "got None"),
        ("f17", ValueError, "Unknown dtype: f17"),
    ],
)
def test_parse_dtype_rejects(value, error, match):
    with pytest.raises(error, match=match):
        jaxamp.policies.parse_dtype(value)


# --- policy tables ----------------------------------------------------------------------

MALFORMED_TABLES = [
    pytest.param([use_compute_precision], "must be a dict.*got list", id="list"),
    pytest.param("bf16", "must be a dict.*got str", id="string"),
    pytest.param(((lax.add_p, use_compute_precision),), "must be a dict.*got tuple", id="pairs"),
    pytest.param({3: use_compute_precision}, r"keys must be primitives.*got 3 \(int\)", id="int_key"),
    pytest.param({jnp.add: use_compute_precision}, r"keys must be primitives.*\(ufunc\)", id="function_key"),
    pytest.param({("blk",): use_compute_precision}, r"keys must be primitives.*\(tuple\)", id="tuple_key"),
    pytest.param({b"blk": use_compute_precision}, r"keys must be primitives.*\(bytes\)", id="bytes_key"),
    pytest.param({lax.add_p: "bf16"}, r"amp_policy\[add\] must be a rule.*got 'bf16'", id="string_rule"),
    pytest.param({"blk": None}, r"amp_policy\['blk'\] must be a rule.*got None", id="none_rule"),
]


@pytest.mark.parametrize("decorator", [False, True], ids=["direct", "decorator"])
@pytest.mark.parametrize("table, match", MALFORMED_TABLES)
def test_malformed_policy_table_rejected_before_tracing(table, match, decorator):
    with pytest.raises(TypeError, match=match):
        amp(amp_policy=table) if decorator else amp(matmul, amp_policy=table)


@pytest.mark.parametrize("table", [{}, types.MappingProxyType({})], ids=["dict", "mappingproxy"])
def test_empty_table_is_valid_and_keeps_original_precision(table):
    jaxpr = jax.make_jaxpr(amp(matmul, amp_policy=table))(X)
    assert all(eqn.primitive.name != "convert_element_type" for eqn in jaxpr.eqns)
    np.testing.assert_array_equal(amp(matmul, amp_policy=table)(X), matmul(X))


# --- rules returning the wrong thing ------------------------------------------------------


def rule_returning(result):
    """A rule named ``my_rule`` that returns ``result(invars, bind_params)``."""

    def my_rule(compute_dtype, original_dtypes, *invars, **bind_params):
        return result(invars, bind_params)

    return my_rule


MALFORMED_RESULTS = [
    pytest.param(lambda i, p: (i[:1], p), ValueError, "returned 1 operands.*takes 2", id="too_few"),
    pytest.param(lambda i, p: ((*i, i[0]), p), ValueError, "returned 3 operands.*takes 2", id="too_many"),
    pytest.param(lambda i, p: i, TypeError, r"must return \(invars, bind_params\)", id="invars_only"),
    pytest.param(lambda i, p: None, TypeError, r"must return \(invars, bind_params\).*NoneType", id="none"),
    pytest.param(lambda i, p: (i, p, p), TypeError, r"must return \(invars, bind_params\)", id="triple"),
    pytest.param(lambda i, p: (i, None), TypeError, r"must return \(invars, bind_params\)", id="params_none"),
    pytest.param(lambda i, p: (5, p), TypeError, r"must return \(invars, bind_params\)", id="invars_int"),
    pytest.param(lambda i, p: "ab", TypeError, r"must return \(invars, bind_params\).*str", id="string"),
]


@pytest.mark.parametrize("result, error, match", MALFORMED_RESULTS)
def test_malformed_rule_result_names_the_rule(result, error, match):
    mixed = amp(matmul, amp_policy={lax.dot_general_p: rule_returning(result)})
    with pytest.raises(error, match=f"rule_returning.<locals>.my_rule \\(chosen by user\\).*{match}"):
        mixed(X)


def _too_few(compute_dtype, original_dtypes, *invars, **bind_params):
    return invars[:1], bind_params


def _scoped_matmul(x):
    with jax.named_scope("blk"):
        return x @ x


def _matmul_in_scan(x):
    return lax.scan(lambda c, _: (jnp.tanh(c @ c), None), x, None, length=2)[0]


@pytest.mark.parametrize(
    "fn, table, named",
    [
        pytest.param(_scoped_matmul, {"blk": _too_few}, r"_too_few \(chosen by scope:blk\)", id="scope_entry"),
        pytest.param(matmul, {"amp_default": _too_few}, r"_too_few \(chosen by amp_default\)", id="amp_default"),
        pytest.param(
            matmul,
            {lax.dot_general_p: functools.partial(_too_few)},
            r"functools.partial\(<function _too_few",
            id="partial_rule",
        ),
        pytest.param(jax.jit(matmul), {lax.dot_general_p: _too_few}, "_too_few", id="inside_jit"),
        pytest.param(_matmul_in_scan, {lax.dot_general_p: _too_few}, "_too_few", id="inside_scan"),
    ],
)
def test_malformed_rule_reported_wherever_it_was_chosen(fn, table, named):
    with pytest.raises(ValueError, match=named):
        amp(fn, amp_policy=table)(X)
    with pytest.raises(ValueError, match=named):
        jax.jit(amp(fn, amp_policy=table))(X)


def test_rule_factory_passed_uncalled_names_itself():
    # `use_precision` instead of `use_precision("bf16")`: callable, so the table
    # is accepted, but its first call says which rule was wrong.
    with pytest.raises(TypeError, match="use_precision"):
        amp(matmul, amp_policy={lax.dot_general_p: use_precision})(X)


# --- amp_stop -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [3, "blk", 1.5, [matmul]], ids=_stable_id)
def test_amp_stop_rejects_non_callables_naming_them(value):
    with pytest.raises(TypeError, match=f"amp_stop expects a function.*got {re.escape(repr(value))}"):
        amp_stop(value)


# --- the policy= argument ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        pytest.param({"policy": "p=f32,c=f17"}, ValueError, "Unknown dtype: f17", id="bad_dtype"),
        pytest.param({"policy": "x=f32"}, ValueError, "Unknown key 'x'", id="bad_key"),
        pytest.param({"policy": 3}, TypeError, "got 3 of type int", id="not_a_policy"),
        pytest.param({"policy": "c=bf16", "compute_dtype": "f16"}, ValueError, "disagree", id="conflict"),
        pytest.param({"policy": "c=bf16", "compute_dtype": "int8"}, TypeError, "int8", id="bad_dtype_beside"),
    ],
)
def test_bad_policy_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        amp(matmul, **kwargs)


def test_policy_with_an_integer_compute_dtype_cannot_be_built():
    with pytest.raises(TypeError, match="int32"):
        Policy(jnp.float32, jnp.int32, jnp.float32)


# --- errors of the user's own ---------------------------------------------------------------------


def test_errors_of_the_function_reach_the_caller_unchanged():
    def broken(x):
        raise ValueError("boom from the user")

    with pytest.raises(ValueError, match="^boom from the user$"):
        amp(broken)(X)
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        amp(lambda x: x @ jnp.ones((3, 3)))(X)
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        amp(matmul)()
