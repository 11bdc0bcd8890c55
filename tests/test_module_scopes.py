"""Module paths as named scopes: what `explain` shows and what policy keys match.

flax Linen names every module call with `jax.named_scope` (``Dense_0``); amp
gives flax nnx modules the same while it traces: the outermost module by its
class name, each submodule by its graph path relative to its caller
(``blocks.0``, then ``attn``). The classes are left as they were afterwards.
"""

import threading

import jax
import jax.numpy as jnp
import pytest

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")

import jaxamp  # noqa: E402

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

X = jnp.ones((2, 8))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.mlp = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.mlp(self.norm(self.attn(x)))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(3)])
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Derived(nnx.Linear):
    """Inherits `__call__`: wrapped on both classes, it must open one scope."""


def _loss(model, x):
    return jnp.mean(model(x) ** 2)


def _matmul_scopes(report):
    return [row.scope for row in report.rows if row.primitive == "dot_general"]


@pytest.mark.newest_only
def test_nnx_module_paths_become_scopes():
    report = jaxamp.explain(_loss, compute_dtype="bf16")(Model(nnx.Rngs(0)), X)
    assert _matmul_scopes(report) == [f"Model/blocks.{i}/{layer}" for i in range(3) for layer in ("attn", "mlp")] + [
        "Model/head"
    ]
    norm_rows = [row for row in report.rows if row.scope == "Model/blocks.1/norm"]
    assert {row.decided_by for row in norm_rows} >= {"statistics"}


@pytest.mark.newest_only
def test_folded_table_groups_nnx_layer_instances():
    report = jaxamp.explain(_loss, compute_dtype="bf16")(Model(nnx.Rngs(0)), X)
    folded = report.table().splitlines()
    attn = [line.split() for line in folded if line.startswith("Model/blocks.*/attn ")]
    # Three instances' matmuls in one scope's rows (split only by the dtypes
    # their operands arrived in: the first block's input is float32).
    assert sum(int(row[2]) for row in attn if row[1] == "dot_general") == 3
    assert not any("blocks.0" in line for line in folded)


@pytest.mark.newest_only
def test_policy_keyed_by_an_nnx_path_scope():
    table = {**jaxamp.default_amp_policy, "head": jaxamp.use_original_precision}
    report = jaxamp.explain(_loss, compute_dtype="bf16", amp_policy=table)(Model(nnx.Rngs(0)), X)
    head = [row for row in report.rows if row.primitive == "dot_general" and row.scope == "Model/head"]
    assert [(row.decided_by, row.dtypes_after) for row in head] == [("scope:head", ("f32", "f32"))]
    others = [row for row in report.rows if row.primitive == "dot_general" and row.scope != "Model/head"]
    assert {row.dtypes_after for row in others} == {("bf16", "bf16")}


def test_module_as_the_function_and_inherited_call_open_one_scope():
    model = Derived(8, 4, rngs=nnx.Rngs(0))
    report = jaxamp.explain(model, compute_dtype="bf16")(X)
    assert _matmul_scopes(report) == ["Derived"]


def test_classes_are_restored_even_when_the_function_raises():
    before = {cls: cls.__dict__.get("__call__") for cls in (Model, Block, nnx.Linear, nnx.LayerNorm, Derived)}

    def broken(model, x):
        model(x)
        raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        jaxamp.amp(broken, compute_dtype="bf16")(Model(nnx.Rngs(0)), X)
    jaxamp.explain(Derived(8, 4, rngs=nnx.Rngs(0)), compute_dtype="bf16")(X)
    after = {cls: cls.__dict__.get("__call__") for cls in before}
    assert after == before


def test_calls_outside_amp_get_no_scope_while_another_thread_traces():
    model = Model(nnx.Rngs(0))
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def slow_loss(model, x):
        y = model(x)
        inside.set()
        outside.wait(timeout=30)
        return jnp.mean(y**2)

    def trace():
        seen["report"] = jaxamp.explain(slow_loss, compute_dtype="bf16")(model, X)

    worker = threading.Thread(target=trace)
    worker.start()
    assert inside.wait(timeout=60)
    # The classes are wrapped now, but this thread's calls are not amp's.
    jaxpr = jax.make_jaxpr(lambda x: Model(nnx.Rngs(1))(x))(X)
    outside.set()
    worker.join()
    names = {str(eqn.source_info.name_stack) for eqn in jaxpr.jaxpr.eqns}
    assert names == {""}
    assert _matmul_scopes(seen["report"])[0] == "Model/blocks.0/attn"


@pytest.mark.newest_only
def test_linen_module_names_are_scopes_and_fold():
    class LinenBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(8)(nn.LayerNorm()(x))

    class LinenModel(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = LinenBlock()(x)
            return nn.Dense(4)(x)

    model = LinenModel()
    params = model.init(jax.random.PRNGKey(0), X)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    report = jaxamp.explain(loss, compute_dtype="bf16")(params, X)
    assert _matmul_scopes(report) == [f"LinenModel/LinenBlock_{i}/Dense_0" for i in range(3)] + ["LinenModel/Dense_0"]
    folded = report.table().splitlines()
    dense = [line.split()[1:3] for line in folded if line.startswith("LinenModel/LinenBlock_*/Dense_* ")]
    assert ["dot_general", "3"] in dense
