"""Path-keyed pytree helpers and the small training-loop utilities."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxamp.sharding import (
    flatten_tree,
    get_metrics,
    get_weight_decay_mask,
    named_tree_map,
    tree_apply,
    tree_path_to_string,
    wrap_function_with_rng,
)


class Opaque:
    """A pytree registered without keys: its children get FlattenedIndexKey."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(Opaque, lambda o: ((o.a, o.b), None), lambda _, c: Opaque(*c))


def paths(tree, sep="/"):
    return list(flatten_tree(tree, sep=sep))


# tree_path_to_string / flatten_tree ---------------------------------------------


def test_every_key_kind_renders_bare():
    tree = {"dict": [Opaque(1, 2)], "mod": eqx.nn.Linear(2, 3, key=jax.random.key(0))}
    assert paths(tree) == ["dict/0/0", "dict/0/1", "mod/weight", "mod/bias"]


def test_path_without_sep_is_a_tuple_and_unknown_keys_use_str():
    class OddKey:
        def __str__(self):
            return "odd"

    path = (jax.tree_util.DictKey("a"), jax.tree_util.SequenceKey(2), OddKey())
    assert tree_path_to_string(path) == ("a", "2", "odd")
    assert tree_path_to_string(path, sep=".") == "a.2.odd"
    assert tree_path_to_string(()) == ()


def test_flatten_tree_keeps_leaves_and_order():
    tree = {"b": {"x": 1}, "a": (2, 3)}
    assert flatten_tree(tree, sep="/") == {"a/0": 2, "a/1": 3, "b/x": 1}
    assert flatten_tree(tree) == {("a", "0"): 2, ("a", "1"): 3, ("b", "x"): 1}


def test_flatten_tree_is_leaf_stops_descent():
    tree = {"a": (1, 2), "b": [3]}
    assert flatten_tree(tree, is_leaf=lambda x: isinstance(x, tuple), sep="/") == {
        "a": (1, 2),
        "b/0": 3,
    }


def test_flatten_tree_on_an_optax_state():
    state = optax.adam(1e-3).init({"w": jnp.ones(2)})
    assert paths(state) == ["0/count", "0/mu/w", "0/nu/w"]


# named_tree_map / tree_apply -----------------------------------------------------


def test_named_tree_map_passes_path_leaf_and_rest():
    tree = {"a": 1, "b": {"c": 2}}
    other = {"a": 10, "b": {"c": 20}}
    out = named_tree_map(lambda path, x, y: f"{path}={x + y}", tree, other, sep=".")
    assert out == {"a": "a=11", "b": {"c": "b.c=22"}}
    assert named_tree_map(lambda path, x: path, tree) == {"a": ("a",), "b": {"c": ("b", "c")}}


def test_named_tree_map_is_leaf():
    out = named_tree_map(
        lambda path, x: (path, len(x)),
        {"a": [1, 2]},
        is_leaf=lambda x: isinstance(x, list),
        sep="/",
    )
    assert out == {"a": ("a", 2)}


def test_tree_apply_applies_leafwise():
    fns = {"a": lambda x: x + 1, "b": [str, lambda x: x * 2]}
    assert tree_apply(fns, {"a": 1, "b": [2, 3]}) == {"a": 2, "b": ["2", 6]}
    with pytest.raises(ValueError):
        tree_apply(fns, {"a": 1})


# get_weight_decay_mask -----------------------------------------------------------


def test_weight_decay_mask_excludes_matching_paths():
    params = {"dense": {"w": 1.0, "b": 2.0}, "norm": {"scale": 3.0}, "embedding": 4.0}
    mask = get_weight_decay_mask([r"/b$", r"^norm/"])(params)
    assert mask == {"dense": {"w": True, "b": False}, "norm": {"scale": False}, "embedding": True}
    # One pattern as a string is one pattern, not a sequence of characters.
    assert get_weight_decay_mask("embedding")(params)["embedding"] is False
    assert get_weight_decay_mask("embedding")(params)["dense"]["b"] is True


def test_weight_decay_mask_drives_optax_adamw():
    params = {"w": jnp.ones(3), "b": jnp.ones(3)}
    opt = optax.adamw(0.1, weight_decay=0.5, mask=get_weight_decay_mask([r"^b$"]))
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero_grads, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones(3), rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], np.zeros(3))


def test_weight_decay_mask_rejects_bad_patterns():
    with pytest.raises(ValueError, match=r"Invalid regular expression '\(b'"):
        get_weight_decay_mask(["(b"])


# get_metrics ---------------------------------------------------------------------


def test_get_metrics_to_floats():
    out = get_metrics({"loss": jnp.float32(0.5), "acc": np.array([0.25]), "n": 3})
    assert out == {"loss": 0.5, "acc": 0.25, "n": 3.0}
    assert all(type(v) is float for v in out.values())


def test_get_metrics_unreplicate_keeps_the_first_copy():
    replicated = {"loss": jnp.array([1.5, 1.5, 1.5]), "lr": jnp.array([0.1, 0.1, 0.1])}
    assert get_metrics(replicated, unreplicate=True) == pytest.approx({"loss": 1.5, "lr": 0.1})


def test_get_metrics_stack():
    history = [{"loss": jnp.float32(i), "acc": jnp.float32(i / 10)} for i in range(4)]
    out = get_metrics(history, stack=True)
    np.testing.assert_allclose(out["loss"], [0, 1, 2, 3])
    assert isinstance(out["acc"], np.ndarray) and out["acc"].shape == (4,)


def test_get_metrics_errors():
    with pytest.raises(ValueError, match=r"Metric 'loss' has shape \(2,\), expected a scalar"):
        get_metrics({"loss": jnp.ones(2)})
    with pytest.raises(TypeError, match="expects a dict of scalar metrics, got list"):
        get_metrics([{"loss": 1.0}])


# wrap_function_with_rng ----------------------------------------------------------


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_wrapped_function_gets_a_fresh_split_each_call(make_key):
    seen = []

    @wrap_function_with_rng(make_key(0))
    def sample(rng, shape):
        """Draw normals."""
        seen.append(rng)
        return jax.random.normal(rng, shape)

    first, second = sample((3,)), sample(shape=(3,))
    assert not np.allclose(first, second)
    assert sample.__name__ == "sample" and sample.__doc__ == "Draw normals."

    rng = make_key(0)
    for got in seen:
        rng, expected = jax.random.split(rng)
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(expected))


def test_wrapped_functions_with_the_same_seed_agree():
    draws = []
    for _ in range(2):
        uniform = functools.partial(jax.random.uniform, shape=())
        f = wrap_function_with_rng(jax.random.key(7))(uniform)
        draws.append([float(f()) for _ in range(3)])
    assert draws[0] == draws[1]
