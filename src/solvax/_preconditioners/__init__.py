"""Preconditioners: diagonal and block-diagonal (`diagonal`: Jacobi, block
Jacobi) and polynomial (`polynomial`: Chebyshev, `estimate_spectrum`)."""
