"""Whole-program analyses amp runs before it rewrites a program: normalisation
statistics (`_statistics`), value ranges (`_ranges`), the regions a rule keeps
together (`_regions`), the program's tail after its last matmul (`_tail`) and
the matmuls whose operands the program widened from half precision (`_upcasts`).

Internal: import the public names from `jaxamp`.
"""
