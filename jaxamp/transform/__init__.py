"""The transform: amp's interpreter, one handler per higher-order primitive, the
policy rules and scopes, float32 accumulation and flax nnx state.

Internal: import the public names from `jaxamp`.
"""
