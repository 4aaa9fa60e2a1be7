"""Polynomial preconditioning: Chebyshev's iteration on a spectral interval
(it applies the operator, so it communicates what the operator does and
nothing more), and `estimate_spectrum` (Lanczos) for its interval."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from .._core import checks, reduce, tree
from .._core.dense import eigvalsh
from .diagonal import PyTree


def chebyshev(matvec: Callable[[PyTree], PyTree], lmin, lmax, *, degree: int = 4):
    """Chebyshev polynomial preconditioner `r -> p(A) r`, `p(A) ~ A^{-1}`.

    `degree` steps of the Chebyshev iteration for `A z = r` from `z = 0`, with
    the spectrum of the Hermitian positive-definite `A` assumed in
    `[lmin, lmax]` (Saad, "Iterative Methods for Sparse Linear Systems",
    Alg. 12.1): with `theta = (lmax + lmin) / 2`, `delta = (lmax - lmin) / 2`,

        d_0 = r / theta,  rho_0 = delta / theta,
        rho_k = 1 / (2 theta / delta - rho_{k-1}),
        d_k = rho_k rho_{k-1} d_{k-1} + (2 rho_k / delta) (r - A z_{k-1}),
        z_k = z_{k-1} + d_k.

    `p` is a fixed polynomial, so the preconditioner is linear and Hermitian
    positive definite as long as `lmax` is not below the largest eigenvalue
    (an overestimate of `lmin` only weakens it): pad an estimate from
    `estimate_spectrum`, e.g. `1.1 * lmax`. It applies the operator
    `degree - 1` times and computes no inner product.

    Args:
        matvec: `x -> A x`.
        lmin, lmax: bounds of the spectrum, `0 < lmin < lmax`.
        degree: polynomial degree (>= 1).

    Returns:
        `precond(r)`.

    Raises:
        ValueError: `degree < 1`, or concrete bounds not `0 < lmin < lmax`.
    """
    degree = checks.check_int("degree", degree, 1)
    for name, value in (("lmin", lmin), ("lmax", lmax)):
        checks.check_tolerance(name, value)
    if not isinstance(lmin, jax.core.Tracer) and not isinstance(lmax, jax.core.Tracer):
        if not 0 < float(lmin) < float(lmax):
            raise ValueError(f"chebyshev needs 0 < lmin < lmax; got lmin={lmin}, lmax={lmax}.")
    theta = (lmax + lmin) / 2
    delta = (lmax - lmin) / 2

    def precond(r):
        d = tree.scale(1 / theta, r)

        def step(_, carry):
            z, d, res, rho = carry
            res = tree.sub(res, matvec(d))
            rho_next = 1 / (2 * theta / delta - rho)
            d = tree.add(tree.scale(rho_next * rho, d), tree.scale(2 * rho_next / delta, res))
            return tree.add(z, d), d, res, rho_next

        z, *_ = lax.fori_loop(1, degree, step, (d, d, r, delta / theta))
        return z

    return precond


def estimate_spectrum(matvec: Callable[[PyTree], PyTree], v: PyTree, *, steps: int = 20,
                      inner_product=None, axis_name=None):
    """Estimate the extreme eigenvalues of a Hermitian `A` with `steps` Lanczos steps.

    Runs the Lanczos recurrence from `v` (two reductions per step; meant for
    setup, not for the solve loop) and returns the extreme Ritz values of the
    tridiagonal matrix: `lmax_ritz <= lmax` from below and `lmin_ritz >= lmin`
    from above, both converging fast at the ends of the spectrum.

    Args:
        matvec: `x -> A x` (Hermitian).
        v: a nonzero start vector (pytree), e.g. the right-hand side.
        steps: Lanczos steps (>= 1); stops early on an invariant subspace.
        inner_product, axis_name: as for the solvers (use `axis_name` inside
            `shard_map`).

    Returns:
        `(lmin_ritz, lmax_ritz)` as real scalars.

    Raises:
        ValueError: `steps < 1`, or a concrete `v` that is zero or not finite
            (a traced one gives `(nan, nan)`: no spectrum can be estimated).

    Reference: C. Lanczos, J. Res. Nat. Bur. Standards 45 (1950).
    """
    steps = checks.check_int("steps", steps, 1)
    checks.check_vector("v", v)
    ip = reduce.resolve(inner_product, axis_name)
    real = jnp.finfo(tree.result_dtype(v)).dtype
    norm = ip.norm(v)
    if not isinstance(norm, jax.core.Tracer) and not float(norm) > 0:
        raise ValueError(f"`v` must be a nonzero start vector with finite entries; its norm "
                         f"is {float(norm)}. Pass e.g. the right-hand side or a random vector.")
    v = tree.scale(1 / norm, v)

    def step(k, carry):
        v, v_prev, beta_prev, alphas, betas, alive = carry
        w = matvec(v)
        alpha = jnp.real(ip.dot(v, w))
        w = tree.sub(tree.sub(w, tree.scale(alpha, v)), tree.scale(beta_prev, v_prev))
        beta = ip.norm(w)
        ok = alive & (beta > 100 * jnp.finfo(real).eps * jnp.abs(alpha))
        alphas = alphas.at[k].set(jnp.where(alive, alpha, jnp.nan))
        betas = betas.at[k].set(jnp.where(ok, beta, 0))
        v_next = tree.scale(1 / jnp.where(ok, beta, 1), w)
        return v_next, v, beta, alphas, betas, ok

    init = (v, tree.zeros_like(v), jnp.zeros((), real), jnp.full((steps,), jnp.nan, real),
            jnp.zeros((steps,), real), jnp.bool_(True))
    _, _, _, alphas, betas, _ = lax.fori_loop(0, steps, step, init)
    # Unused rows (after an early stop) are decoupled and parked on a used diagonal
    # entry, which lies inside the Ritz range, so they do not move its ends.
    diag = jnp.where(jnp.isnan(alphas), alphas[0], alphas)
    T = jnp.diag(diag) + jnp.diag(betas[:-1], 1) + jnp.diag(betas[:-1], -1)
    ritz = eigvalsh(T)
    return ritz[0], ritz[-1]
