"""jaxamp: automatic mixed precision for JAX."""

from ._dtypes import cast_floating, half_dtype, parse_dtype

__all__ = [
    "cast_floating",
    "half_dtype",
    "parse_dtype",
]
