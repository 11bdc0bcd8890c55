"""Diagnostics: `explain` (what ran in which dtype, and why), `find_nonfinite` and `compare`.

Internal: import the public names from `jaxamp`.
"""
