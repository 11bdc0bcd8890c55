"""Diagnostics: `explain` (what ran in which dtype, and why) and `find_nonfinite`.

Internal: import the public names from `jaxamp`.
"""
