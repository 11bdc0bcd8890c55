"""jmp-style precision policies and dtype helpers.

`Policy` names the dtypes of parameters, computation and outputs; `get_policy`
reads the policy strings of jmp and eformer (``"p=f32,c=bf16,o=f32"``,
``"params=float32,compute=half"``, ``"bf16"``). `cast_to_full`, `cast_to_half`
and `half_dtype` are jmp's helpers; `cast_floating` casts every floating leaf of
a pytree and `parse_dtype` reads a dtype name (``"bf16"``, ``"half"``). The
guide is docs/policies.md.

`Policy`, `get_policy`, `cast_to_full`, `cast_to_half` and `half_dtype` are also
at the top level, as in jmp (``import jaxamp as jmp``).
"""

from .._dtypes import cast_floating, half_dtype, parse_dtype
from ._policy import Policy, cast_to_full, cast_to_half, get_policy

__all__ = ["Policy", "cast_floating", "cast_to_full", "cast_to_half", "get_policy", "half_dtype", "parse_dtype"]
