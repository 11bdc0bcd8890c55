"""Policy, the policy-string grammar, casting of mixed pytrees, and docs/policies.md."""

import dataclasses
import functools
import pathlib
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import jaxamp
from jaxamp import Policy, get_policy

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
HALF = jaxamp.half_dtype()

# The spellings, written out rather than read from jaxamp so that the
# tests pin the grammar instead of echoing the implementation's table.
NAMES = {F32: ("f32", "float32", "full"), BF16: ("bf16", "bfloat16"), F16: ("f16", "float16")}
KEYS = {
    "param_dtype": ("p", "params"),
    "compute_dtype": ("c", "compute"),
    "output_dtype": ("o", "output"),
}

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def dtypes(policy):
    return policy.param_dtype, policy.compute_dtype, policy.output_dtype


def names_of(dtype):
    return NAMES[dtype] + (("half",) if dtype == HALF else ())


# --- grammar ---------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype", [(n, d) for d, ns in NAMES.items() for n in ns] + [("half", HALF)])
def test_one_dtype_sets_all_three(name, dtype):
    assert dtypes(get_policy(name)) == (dtype, dtype, dtype)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("c=f16", (F32, F16, F16)),  # params default to f32, output follows compute
        ("p=bf16", (BF16, BF16, BF16)),  # compute follows params
        ("o=bf16", (F32, F32, BF16)),
        ("p=f16,c=bf16", (F16, BF16, BF16)),
        ("c=bf16,o=full", (F32, BF16, F32)),
        ("c=half", (F32, HALF, HALF)),
        ("o=f32,c=bf16,p=f16", (F16, BF16, F32)),
        ("params=bf16,compute=float16,output=float32", (BF16, F16, F32)),
        (" p = f32 ,\tc = BF16 , O=Full \n", (F32, BF16, F32)),
        ("  BFloat16\t", (BF16, BF16, BF16)),
    ],
)
def test_key_value_grammar_and_defaults(text, expected):
    assert dtypes(get_policy(text)) == expected
    assert Policy.from_string(text) == get_policy(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("f17", "Unknown dtype: f17"),
        ("compute_float16", "Unknown dtype: compute_float16"),
        ("p=f32, c=f17", "Unknown dtype: f17"),
        ("x=f32", "Unknown key 'x' in policy 'x=f32'"),
        ("p=f32,param=bf16", "Unknown key 'param'"),
        ("p=f32,p=bf16", "Repeated key 'p' in policy 'p=f32,p=bf16'"),
        ("c=f16, compute=bf16", "Repeated key 'compute'"),  # an alias repeats too
        ("", "Empty policy string ''"),
        (" \t", "Empty policy string ' \\t'"),
        ("c=f16,", "Malformed entry '' in policy 'c=f16,'"),
        ("p=f32,bf16", "Malformed entry 'bf16'"),
        ("c=", "Missing dtype after '=' in policy 'c='"),
        ("f64", "Unsupported dtype: f64 (float64)"),
        ("p=float64", "Unsupported dtype: float64 (float64) in policy 'p=float64'"),
    ],
)
def test_invalid_strings_raise_value_error_naming_the_text(text, message):
    for parse in (get_policy, Policy.from_string):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse(text)


def test_errors_list_what_was_expected():
    with pytest.raises(ValueError, match="expected one of: .*bf16.*f32.*half"):
        get_policy("c=f17")
    with pytest.raises(ValueError, match="expected p/params, c/compute or o/output"):
        get_policy("q=f32")


@pytest.mark.parametrize("value", [None, 3, jnp.float32, ["f32"]])
def test_non_strings_are_type_errors_naming_the_value(value):
    with pytest.raises(TypeError, match=re.escape(repr(value))):
        get_policy(value)
    with pytest.raises(TypeError, match=re.escape(repr(value))):
        Policy.from_string(value)


def test_get_policy_returns_a_policy_as_is():
    policy = Policy(F32, BF16, F32)
    assert get_policy(policy) is policy


# --- the Policy record --------------------------------------------------------


@pytest.mark.parametrize("spelling", [jnp.bfloat16, np.dtype(jnp.bfloat16), "bf16", " BFloat16 "])
def test_fields_are_numpy_dtypes_equal_across_spellings(spelling):
    policy = Policy(jnp.float32, spelling, np.float32)
    assert all(isinstance(d, np.dtype) for d in dtypes(policy))
    assert policy.compute_dtype == jnp.bfloat16 and policy.param_dtype == np.float32
    assert policy == Policy(F32, BF16, F32)
    assert hash(policy) == hash(Policy(F32, BF16, F32))
    assert policy != Policy(F32, F16, F32)


@pytest.mark.parametrize(
    "value, error, message",
    [
        (jnp.int32, TypeError, "int32"),
        (jnp.float64, TypeError, "float64"),
        (jnp.complex64, TypeError, "complex64"),
        (None, TypeError, "got None"),
        (object(), TypeError, "object"),
        ("f17", ValueError, "'f17'"),
    ],
)
def test_constructor_validates_each_field(value, error, message):
    for field in KEYS:
        kwargs = {"param_dtype": F32, "compute_dtype": F32, "output_dtype": F32, field: value}
        with pytest.raises(error, match=f"{field}.*{message}"):
            Policy(**kwargs)


def test_policy_is_frozen():
    policy = Policy(F32, BF16, F32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = F16


def test_with_output_dtype_returns_a_validated_copy():
    policy = Policy(F32, BF16, F32)
    assert policy.with_output_dtype(jnp.bfloat16) == Policy(F32, BF16, BF16)
    assert policy.output_dtype == F32
    with pytest.raises(TypeError, match="output_dtype.*float64"):
        policy.with_output_dtype(jnp.float64)


@pytest.mark.parametrize(
    "policy, text",
    [
        (Policy(F32, BF16, F32), "p=f32,c=bf16,o=f32"),
        (Policy(F16, F16, F16), "p=f16,c=f16,o=f16"),
        (Policy(BF16, F32, F16), "p=bf16,c=f32,o=f16"),
    ],
)
def test_str_prints_short_names(policy, text):
    assert str(policy) == text


def test_policy_is_a_static_jit_argument():
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_output(policy.cast_to_compute(x) * 2)

    x = jnp.ones(3)
    assert f(x, get_policy("p=f32,c=bf16,o=f16")).dtype == F16
    # An equal policy spelled differently hits the same cache entry.
    assert f(x, Policy(jnp.float32, "bf16", np.float16)).dtype == F16
    assert len(traces) == 1
    assert f(x, get_policy("bf16")).dtype == BF16
    assert len(traces) == 2


# --- casting ---------------------------------------------------------------------


def mixed_tree():
    # Values exact in float16 and bfloat16, so a cast must preserve them exactly.
    return {
        "jax_f32": jnp.array([0.0, 0.5, 1.5]),
        "jax_bf16": jnp.array([2.0, -1.0], jnp.bfloat16),
        "jax_int": jnp.arange(3),
        "np_f32": np.array([0.25, 4.0], np.float32),
        "np_f64": np.array([1.0, 0.5]),
        "np_bool": np.array([True, False]),
        "nested": [7, 2.5, ("label", None, object())],
    }


def assert_cast(before, after, dtype):
    assert jax.tree_util.tree_structure(after) == jax.tree_util.tree_structure(before)
    for key, array_type in [
        ("jax_f32", jax.Array),
        ("jax_bf16", jax.Array),
        ("np_f32", np.ndarray),
        ("np_f64", np.ndarray),
    ]:
        assert isinstance(after[key], array_type), key
        assert after[key].dtype == dtype, key
        np.testing.assert_array_equal(np.asarray(after[key], np.float64), np.asarray(before[key], np.float64))
    for key in ("jax_int", "np_bool"):
        assert after[key] is before[key]
    leaves = jax.tree_util.tree_leaves
    for x, y in zip(leaves(before["nested"]), leaves(after["nested"]), strict=True):
        assert y is x


@pytest.mark.parametrize(
    "method, field",
    [
        ("cast_to_param", "param_dtype"),
        ("cast_to_compute", "compute_dtype"),
        ("cast_to_output", "output_dtype"),
    ],
)
def test_policy_casts_only_floating_array_leaves(method, field):
    policy = Policy(F16, BF16, F32)  # three different dtypes: each method must use its own
    tree = mixed_tree()
    assert_cast(tree, getattr(policy, method)(tree), getattr(policy, field))


@pytest.mark.parametrize("cast, dtype", [(jaxamp.cast_to_full, F32), (jaxamp.cast_to_half, HALF)])
def test_cast_to_full_and_half(cast, dtype):
    tree = mixed_tree()
    assert_cast(tree, cast(tree), dtype)


def test_casting_works_on_tracers():
    policy = get_policy("c=bf16,o=f32")
    out = jax.jit(lambda t: policy.cast_to_compute(t))({"x": jnp.ones(2), "n": jnp.arange(2)})
    assert out["x"].dtype == BF16 and out["n"].dtype == jnp.arange(2).dtype


# --- properties ------------------------------------------------------------------

dtype_st = st.sampled_from(list(NAMES))
policies = st.builds(Policy, dtype_st, dtype_st, dtype_st)
whitespace = st.text(alphabet=" \t\n", max_size=2)


def respell(draw, word):
    """`word` in random case, padded with random whitespace."""
    cased = "".join(c.upper() if draw(st.booleans()) else c for c in word)
    return draw(whitespace) + cased + draw(whitespace)


@st.composite
def spelled_policies(draw):
    """A policy and a random spelling of it: aliases, case, whitespace, order, defaults."""
    policy = draw(policies)
    defaults = {
        "param_dtype": F32,
        "compute_dtype": policy.param_dtype,
        "output_dtype": policy.compute_dtype,
    }
    entries = []
    for field, keys in KEYS.items():
        dtype = getattr(policy, field)
        if dtype == defaults[field] and draw(st.booleans()):
            continue  # leave it to the default
        key = respell(draw, draw(st.sampled_from(keys)))
        entries.append(f"{key}={respell(draw, draw(st.sampled_from(names_of(dtype))))}")
    if not entries:
        return policy, respell(draw, "p") + "=" + respell(draw, "f32")
    return policy, ",".join(draw(st.permutations(entries)))


@settings(deadline=None)
@given(policies)
def test_str_round_trips(policy):
    assert get_policy(str(policy)) == policy


@settings(deadline=None, max_examples=300)
@given(spelled_policies())
def test_spelling_variants_parse_the_same(case):
    policy, text = case
    assert get_policy(text) == policy


@settings(deadline=None)
@given(st.data(), dtype_st)
def test_single_name_variants_parse_the_same(data, dtype):
    name = data.draw(st.sampled_from(names_of(dtype)))
    text = respell(data.draw, name)
    assert dtypes(get_policy(text)) == (dtype, dtype, dtype)


# --- docs and exports --------------------------------------------------------------

DOC_BLOCKS = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)


@pytest.mark.parametrize("block", DOC_BLOCKS, ids=[f"block{i}" for i in range(len(DOC_BLOCKS))])
def test_docs_examples_run(block):
    exec(compile(block, str(DOCS), "exec"), {})


def test_docs_have_examples():
    assert len(DOC_BLOCKS) >= 2


def test_public_names():
    names = ("Policy", "get_policy", "cast_to_full", "cast_to_half", "half_dtype")
    for name in names:
        assert name in jaxamp.__all__ and hasattr(jaxamp, name)
    # The dtype helpers live with the policies.
    for name in (*names, "parse_dtype", "cast_floating"):
        assert name in jaxamp.policies.__all__ and hasattr(jaxamp.policies, name)
