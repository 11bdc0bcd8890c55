"""Which test functions the oldest-JAX leg of .ci/run can leave to the newest leg.

The oldest leg is there to find what differs between JAX versions in jaxamp's
own code paths. A test function earns its place there when it reaches a branch
of ``jaxamp/`` on the oldest JAX that no other test of the leg reaches. This
script reads a branch-coverage run of the leg, one coverage context per test,
and picks test functions (all their parametrizations together) greedily, most
new branches per second first, until every branch the leg reaches is reached;
it keeps as well every test that runs jaxamp in subprocesses or reaches none of
it (coverage cannot see those), every test parametrized over JAX's own catalogue
of operations (``catalogue`` in its name: the cases themselves differ between
versions), and one test function of every module. It prints the others: mark
them ``@pytest.mark.newest_only`` (they still run on the newest JAX, as every
test does).

Run on the oldest JAX (pytest-cov is not among the project's dependencies; the
empty ``addopts`` runs the tests in this process, without xdist's ``--dist``,
under which pytest-cov records no per-test contexts)::

    pip install pytest-cov
    pytest -o addopts="" -m "jax_internals and not newest_only" --cov=jaxamp --cov-branch \\
        --cov-context=test --cov-report= --junitxml=oldest.xml
    python .ci/oldest_selection.py .coverage oldest.xml
"""

import collections
import sqlite3
import sys
import xml.etree.ElementTree as ET


def _function(node_id: str) -> str:
    return node_id.split("[")[0]


def branches_by_function(coverage_db: str) -> dict[str, set]:
    db = sqlite3.connect(coverage_db)
    contexts = dict(db.execute("select id, context from context"))
    reached = collections.defaultdict(set)
    for file_id, context_id, start, end in db.execute("select file_id, context_id, fromno, tono from arc"):
        context = contexts[context_id]
        if context:  # "" is code run at import, by no test
            reached[_function(context.rsplit("|", 1)[0])].add((file_id, start, end))
    return reached


def seconds_by_function(junit_xml: str) -> dict[str, float]:
    seconds: collections.Counter = collections.Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname").rsplit(".", 1)[-1]
        seconds[_function(f"tests/{module}.py::{case.get('name')}")] += float(case.get("time"))
    return seconds


def skippable(reached: dict[str, set], seconds: dict[str, float]) -> list[str]:
    keep = {f for f in seconds if not reached.get(f) or "catalogue" in f}
    remaining = set().union(*reached.values()) - set().union(*(reached.get(f, set()) for f in keep))
    candidates = {f: branches for f, branches in reached.items() if f not in keep}
    while remaining:
        best = max(candidates, key=lambda f: len(candidates[f] & remaining) / max(seconds.get(f, 1.0), 0.05))
        keep.add(best)
        remaining -= candidates.pop(best)
    for module in {f.split("::")[0] for f in seconds}:
        functions = [f for f in seconds if f.split("::")[0] == module]
        if not keep.intersection(functions):
            keep.add(min(functions, key=seconds.__getitem__))
    return sorted(set(seconds) - keep)


def main(coverage_db: str, junit_xml: str) -> None:
    seconds = seconds_by_function(junit_xml)
    skip = skippable(branches_by_function(coverage_db), seconds)
    print(
        f"# {len(skip)} of {len(seconds)} test functions, {sum(seconds[f] for f in skip):.0f} of "
        f"{sum(seconds.values()):.0f} s, reach no branch of jaxamp the others do not:"
    )
    print("\n".join(skip))


if __name__ == "__main__":
    main(*sys.argv[1:])
