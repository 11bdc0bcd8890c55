"""fp8 mode: `Fp8Recipe` (`_recipe`) and the scaled float8 matmul with its policy
rule (`_matmul`).

Internal: import the public names from `jaxamp`.
"""
