"""jaxamp's benchmark suite: ``python benchmarks/run.py --help``.

A package so that the examples and the tests can import `benchmarks.models`.
"""
