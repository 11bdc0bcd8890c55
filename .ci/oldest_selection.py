"""Which tests the oldest-JAX leg of .ci/run can leave to the newest leg.

The oldest leg is there to find what differs between JAX versions in jaxamp's
own code paths. A test earns its place there when it reaches a branch of
``jaxamp/`` on the oldest JAX that no other test of the leg reaches. This
script reads a branch-coverage run of the leg, one coverage context per test
(each parametrization its own), and picks tests greedily, most new branches
per second first, until every branch the leg reaches is reached. It keeps as
well every test that runs jaxamp in subprocesses or reaches none of it
(coverage cannot see those), every test whose cases are JAX's own code, which
differs between versions (`ALWAYS`), and one test of every module. It writes
the others, one test id a line, to ``.ci/oldest_deselected.txt``, which .ci/run
hands the leg (``JAXAMP_TESTS_DESELECT``, tests/conftest.py): they still run on
the newest JAX, as every test does. Tests marked ``@pytest.mark.newest_only`` (a
compute dtype or a layout that takes the same code path, or whole functions an
earlier version of this script picked) are not in the run it reads.

Run on the oldest JAX (pytest-cov is not among the project's dependencies; the
empty ``addopts`` runs the tests in this process, without xdist's ``--dist``,
under which pytest-cov records no per-test contexts)::

    pip install pytest-cov
    pytest -o addopts="" -m "jax_internals and not newest_only" --cov=jaxamp --cov-branch \\
        --cov-context=test --cov-report= --junitxml=oldest.xml
    python .ci/oldest_selection.py .coverage oldest.xml > .ci/oldest_deselected.txt
"""

import collections
import sqlite3
import sys
import xml.etree.ElementTree as ET

# Tests whose cases are JAX's own code: its catalogue of operations, and its
# softmax under each setting of the jax_softmax_custom_jvp flag.
ALWAYS = ("catalogue", "with_the_flag_on_and_off")


def branches_by_test(coverage_db: str) -> dict[str, set]:
    db = sqlite3.connect(coverage_db)
    contexts = dict(db.execute("select id, context from context"))
    reached = collections.defaultdict(set)
    for file_id, context_id, start, end in db.execute("select file_id, context_id, fromno, tono from arc"):
        context = contexts[context_id]
        if context:  # "" is code run at import, by no test
            reached[context.rsplit("|", 1)[0]].add((file_id, start, end))
    return reached


def seconds_by_test(junit_xml: str) -> dict[str, float]:
    seconds: collections.Counter = collections.Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname").rsplit(".", 1)[-1]
        seconds[f"tests/{module}.py::{case.get('name')}"] += float(case.get("time"))
    return seconds


def skippable(reached: dict[str, set], seconds: dict[str, float]) -> list[str]:
    keep = {t for t in seconds if not reached.get(t) or any(name in t for name in ALWAYS)}
    candidates = {t: reached[t] for t in seconds if t not in keep}
    remaining = set().union(*candidates.values()) - set().union(*(reached.get(t, set()) for t in keep))
    while remaining:
        best = max(candidates, key=lambda t: len(candidates[t] & remaining) / max(seconds[t], 0.05))
        keep.add(best)
        remaining -= candidates.pop(best)
    for module in {t.split("::")[0] for t in seconds}:
        tests = [t for t in seconds if t.split("::")[0] == module]
        if not keep.intersection(tests):
            keep.add(min(tests, key=seconds.__getitem__))
    return sorted(set(seconds) - keep)


def main(coverage_db: str, junit_xml: str) -> None:
    seconds = seconds_by_test(junit_xml)
    skip = skippable(branches_by_test(coverage_db), seconds)
    print(
        f"# {len(skip)} of {len(seconds)} tests, {sum(seconds[t] for t in skip):.0f} of "
        f"{sum(seconds.values()):.0f} s, reach no branch of jaxamp the others do not "
        "(.ci/oldest_selection.py):"
    )
    print("\n".join(skip))


if __name__ == "__main__":
    main(*sys.argv[1:])
