"""Input checks shared by `low_precision_params` and `cast_state`."""

from __future__ import annotations

from typing import Any

import optax

__all__ = ["as_optimizer"]


def as_optimizer(owner: str, optimizer: Any) -> optax.GradientTransformationExtraArgs:
    """`optimizer` with extra-args support, or a TypeError naming `owner`.

    Anything with ``init`` and ``update`` functions qualifies, so `optax.MultiSteps`
    (a class, not a `GradientTransformation`) does too.
    """
    if not all(callable(getattr(optimizer, name, None)) for name in ("init", "update")):
        raise TypeError(
            f"{owner} expects an optax GradientTransformation (something with init and "
            f"update functions), got {optimizer!r}."
        )
    return optax.with_extra_args_support(optimizer)
