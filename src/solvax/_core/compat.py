"""Shims for the oldest supported JAX, applied once on import."""

from __future__ import annotations

import inspect

from jax._src import ad_util
from jax._src.interpreters import ad
from jax._src.lax.control_flow import solves


def _instantiate_linear_solve_cotangents() -> None:
    """jax 0.4.38's transpose of `custom_linear_solve` binds the cotangent as
    it comes, symbolic zeros included, so reverse mode through a pytree solve
    whose loss reads only some leaves failed with "Zero(...) is not a valid
    JAX type" (later JAX instantiates them; this does the same there)."""
    rule = ad.primitive_transposes[solves.linear_solve_p]
    try:
        if "instantiate" in inspect.getsource(rule):
            return
    except (OSError, TypeError):  # no source to read: leave JAX as it is
        return

    def instantiating(cotangent, *primals, **params):
        return rule([ad_util.instantiate(c) for c in cotangent], *primals, **params)

    ad.primitive_transposes[solves.linear_solve_p] = instantiating


_instantiate_linear_solve_cotangents()
