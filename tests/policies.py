"""A user's own ``jax.checkpoint`` policy, named in a spec as ``function: "tests.policies:save_softmax"``.

The v5e write-up's custom policy saves the attention softmax: the probabilities are the
output of an elementwise op that is cheap to store relative to recomputing the scores'
matmul, exp and sum. No model here tags them with ``checkpoint_name``, so the policy knows
them by their operation, as ``jax.checkpoint`` shows it to a policy: ``jax.nn.softmax``
ends with ``div(exp(s - max), sum(exp(s - max), axis=-1, keepdims=True))``, a division of an
array by its own sums over the last axis.
"""

from __future__ import annotations

from typing import Any


def save_softmax(prim: Any, *avals: Any, **params: Any) -> bool:
    """Save the output of softmax's normalisation (``x / x.sum(-1, keepdims=True)``), only it."""
    if prim.name != "div" or len(avals) != 2:
        return False
    numerator, denominator = (getattr(a, "shape", ()) for a in avals)
    return (
        len(numerator) >= 2 and len(denominator) == len(numerator) and numerator[-1] > 1
        and denominator[-1] == 1 and denominator[:-1] == numerator[:-1]
    )


not_a_function = 42
"""For the test of a policy path that names something that is not a function."""
