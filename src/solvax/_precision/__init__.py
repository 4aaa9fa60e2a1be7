"""Precision: narrowing an operator or preconditioner (`narrowing`: `lowered`,
`mixed_precision`) and iterative refinement (`refinement`, registered as a
solver)."""

from . import refinement  # noqa: F401  (registers iterative_refinement)
