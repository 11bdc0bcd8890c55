"""Every Python code block in README.md and docs/*.md runs, so the docs cannot rot.

A ```text block right after a Python block (separated by prose only) is its shown
output: each of its lines must appear, in order, in what the block printed. A block
that starts JAX's distributed runtime runs in a fresh process, since
`jax.distributed.initialize` must precede any other JAX call. A block that
imports a framework jaxamp does not depend on, even for development (Tunix),
is skipped where that framework is not installed.
"""

import contextlib
import importlib.util
import io
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Frameworks some blocks port to that are not among pyproject.toml's dev extras.
OPTIONAL = ("tunix", "maxtext")


def _blocks():
    for path in DOCS:
        text = path.read_text()
        blocks = [(m.group(1), m.group(2), text.count("\n", 0, m.start(2)) + 1, m) for m in FENCE.finditer(text)]
        for i, (lang, code, line, match) in enumerate(blocks):
            if lang != "python":
                continue
            shown = None
            if i + 1 < len(blocks) and blocks[i + 1][0] == "text":
                between = text[match.end() : blocks[i + 1][3].start()]
                if "```" not in between:
                    shown = blocks[i + 1][1]
            yield pytest.param(path, code, line, shown, id=f"{path.name}:{line}")


@pytest.mark.parametrize("path, code, line, shown", list(_blocks()))
def test_code_block_runs(path, code, line, shown):
    for name in OPTIONAL:
        if re.search(rf"^(from|import) {name}\b", code, re.M) and importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")
    if "jax.distributed.initialize" in code:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{path.name}:{line} failed:\n{result.stderr[-3000:]}"
        return
    # Pad so tracebacks (and jaxamp's source-line reports) point into the file.
    source = "\n" * (line - 1) + code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, path.name, "exec"), {"__name__": f"docs_{path.stem}"})
    if shown is not None:
        printed = out.getvalue().splitlines()
        position = 0
        for expected in shown.splitlines():
            # Word by word: a table's columns are as wide as their widest row,
            # which may be one the docs leave out (a source line JAX cached from
            # another caller of the same jnp function).
            matches = [j for j in range(position, len(printed)) if printed[j].split() == expected.split()]
            assert matches, f"{path.name}:{line}: shown output line {expected!r} not printed:\n{out.getvalue()}"
            position = matches[0] + 1


def test_porting_shows_the_maxtext_driver_as_it_is():
    """docs/porting.md's MaxText driver is examples/maxtext_driver.py's code, which test_maxtext runs."""
    driver = (ROOT / "examples" / "maxtext_driver.py").read_text()
    code = driver[driver.index("import os\n") :]
    assert code in [m.group(2) for m in FENCE.finditer((ROOT / "docs" / "porting.md").read_text())]
