"""The package's layers: no module imports a layer above its own, and no circle of imports.

The layers and what each may import are docs/architecture.md's table. Every
``import`` in jaxamp counts, at module level or inside a function (a deferred
import still ties the two modules together), ``if TYPE_CHECKING`` blocks
included. Imports of other packages (jax, flax...) are not jaxamp's layers.
"""

import ast
import pathlib

import pytest

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxamp"

# Bottom to top, as in docs/architecture.md; a module's layer is its
# subpackage, or its own name for a module flat in jaxamp/.
LAYER_OF = {
    "_compat": "ground",
    "_dtypes": "ground",
    "_casting": "ground",
    "_jaxpr": "ground",
    "analyses": "analyses",
    "transform": "transform",
    "fp8": "fp8",
    "scaling": "scaling",
    "policies": "policies",
    "optim": "optim",
    "sharding": "sharding",
    "monitoring": "monitoring",
    "_options": "options",
    "_eager_cache": "entry",
    "_amp": "entry",
    "_amp_module": "entry",
    "diagnostics": "entry",
    "__init__": "entry",
}
MAY_IMPORT = {
    "ground": {"ground"},
    "analyses": {"ground"},
    "transform": {"ground", "analyses"},
    "fp8": {"ground", "transform"},
    "scaling": {"ground", "transform"},
    "policies": {"ground"},
    "optim": {"ground"},
    "sharding": {"ground"},
    "monitoring": {"ground"},
    "options": {"ground", "analyses", "transform", "fp8", "policies"},
    "entry": set(LAYER_OF.values()),
}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module names relative to jaxamp ("transform._rules", "__init__") -> file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    head = module.split(".")[0]
    return LAYER_OF[head]


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The jaxamp modules a relative ``from ... import ...`` of `module` names."""
    package = module.split(".")[:-1]
    if module.endswith("__init__"):
        package = module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    target = base + (node.module.split(".") if node.module else [])
    named = []
    for alias in node.names:
        as_module = ".".join([*target, alias.name])
        if as_module in MODULES or f"{as_module}.__init__" in MODULES:
            named.append(as_module if as_module in MODULES else f"{as_module}.__init__")
    if named:
        return named
    dotted = ".".join(target)
    return [dotted if dotted in MODULES else f"{dotted}.__init__"]


def _imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.update(_resolve(module, node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(n == "jaxamp" or n.startswith("jaxamp.") for n in names), (
                f"{module} imports jaxamp absolutely: use a relative import"
            )
    found.discard(module)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_module_has_a_layer():
    assert all(module.split(".")[0] in LAYER_OF for module in MODULES), sorted(MODULES)


def test_at_most_eight_modules_stay_flat():
    flat = [m for m in MODULES if "." not in m]
    assert len(flat) <= 8, flat


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_layer_it_may_not(module):
    layer = _layer(module)
    wrong = sorted(
        f"{target} ({_layer(target)})"
        for target in GRAPH[module]
        if _layer(target) != layer and _layer(target) not in MAY_IMPORT[layer]
    )
    assert not wrong, f"{module} ({layer}) imports {wrong}; see docs/architecture.md"


def _find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in `graph` (depth first: a module met again while open), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            return circle
    return None


def test_no_circle_of_imports():
    circle = _find_circle(GRAPH)
    assert circle is None, "circle of imports: " + " -> ".join(circle or ())


def test_the_checker_sees_a_circle():
    # The circles this layout removed: _amp -> _eager_cache -> _amp, and
    # _amp -> _fp8 -> _diagnostics -> _amp.
    old = {
        "_amp": {"_eager_cache", "_fp8"},
        "_eager_cache": {"_amp"},
        "_fp8": {"_diagnostics"},
        "_diagnostics": {"_amp"},
    }
    assert _find_circle(old) == ["_amp", "_eager_cache", "_amp"]
    assert _find_circle({k: v - {"_eager_cache"} for k, v in old.items()}) == ["_amp", "_fp8", "_diagnostics", "_amp"]


def _jax_internals(tree: ast.AST) -> list[str]:
    """The ``jax._src`` modules `tree` imports: ``import jax._src.x``, ``from jax._src.x import``, ``from jax import _src``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "jax._src" or a.name.startswith("jax._src.")]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "jax._src" or node.module.startswith("jax._src."):
                found.append(node.module)
            elif node.module == "jax" and any(a.name == "_src" for a in node.names):
                found.append("jax._src")
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] != "_compat"))
def test_only_the_compat_layer_imports_jax_internals(module):
    # A JAX upgrade that moves an internal should touch jaxamp/_compat/ only.
    found = _jax_internals(ast.parse(MODULES[module].read_text()))
    assert not found, f"{module} imports {found}: go through jaxamp._compat"


def test_the_checker_sees_jax_internals():
    code = "import jax._src.core\nfrom jax._src.interpreters import ad\nfrom jax import _src, numpy\nimport jax.extend"
    assert _jax_internals(ast.parse(code)) == ["jax._src.core", "jax._src.interpreters", "jax._src"]
    assert _jax_internals(ast.parse(MODULES["_compat._tracing"].read_text()))


def _defined(tree: ast.Module) -> set[str]:
    """The public names a module defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("_compat._") and m != "_compat.__init__"))
def test_the_compat_layer_exports_every_name_it_defines(module):
    # Callers say `_compat.name`: `_compat/__init__.py` re-exports each module's __all__.
    import importlib

    exported = set(importlib.import_module(f"jaxamp.{module}").__all__)
    missing = sorted(_defined(ast.parse(MODULES[module].read_text())) - exported)
    assert not missing, f"add {missing} to jaxamp/{module.replace('.', '/')}.py's __all__"


def test_the_checker_sees_an_upward_import(tmp_path):
    # The check itself can fail: a ground module importing the transform would be caught.
    node = ast.parse("from .transform._rules import freeze").body[0]
    (target,) = _resolve("_casting", node)
    assert target == "transform._rules"
    assert _layer(target) not in MAY_IMPORT[_layer("_casting")]
