"""The examples are scripts, not a package: the tests import them from their files."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str, module_name: str | None = None) -> ModuleType:
    """``examples/<name>.py`` run afresh as the module `module_name` (default ``example_<name>``).

    Registered in ``sys.modules`` before it runs: dataclasses and pickling look
    their module up there.
    """
    spec = importlib.util.spec_from_file_location(module_name or f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
