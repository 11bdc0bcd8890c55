"""jmp-style `Policy` objects and policy strings (``"p=f32,c=bf16,o=f32"``).

Internal: import the public names from `jaxamp`.
"""
