"""What is particular to s-step CG (`pcg(method="s_step")`); the generic
behaviour (pytrees, shardings, shard_map, vmap, grad, dtypes, bad input,
counts) is tested for every entry of `helpers.SOLVERS`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import poisson_2d, random_spd, rel_err, rhs

import solvax as sx
from solvax import Status
from solvax._krylov.sstep import leja_order


def true_rel_residual(matvec, b, x):
    return float(jnp.linalg.norm(b - matvec(x)) / jnp.linalg.norm(b))


@pytest.mark.parametrize("basis", ["chebyshev", "newton"])
@pytest.mark.parametrize("s", [2, 4, 8])
def test_s_step_reaches_the_tolerance_with_cg_matvecs(s, basis):
    """Poisson 64^2 (condition 1.7e3) to 1e-8: every s reaches it on the true
    residual; matvecs within 1.15x of standard PCG for s <= 4 (s = 8 too here)."""
    b = rhs((64, 64), seed=4)
    ref = sx.pcg(poisson_2d, b, rtol=1e-8)
    sol = sx.pcg(poisson_2d, b, rtol=1e-8, method="s_step", s=s, basis=basis)
    assert bool(sol.converged), sol.message
    assert true_rel_residual(poisson_2d, b, sol.x) <= 1e-8
    assert int(sol.iterations) % s == 0
    assert int(sol.iterations) <= 1.15 * int(ref.iterations) + s


@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.float32])
def test_s_step_matches_a_dense_solve(dtype):
    A = jnp.asarray(random_spd(40, seed=5, dtype=dtype))
    b = rhs(40, seed=6, dtype=dtype)
    rtol = 1e-5 if dtype == np.float32 else 1e-10
    sol = sx.pcg(lambda x: A @ x, b, rtol=rtol, method="s_step", s=4)
    assert bool(sol.converged), sol.message
    ref = np.linalg.solve(np.asarray(A, np.complex128), np.asarray(b, np.complex128))
    assert rel_err(sol.x, ref) < (1e-3 if dtype == np.float32 else 1e-7)


def test_given_spectrum_and_estimated_spectrum_agree():
    """Bounds from `estimate_spectrum` (traced, under jit) or Ritz values of
    each block: the same iterates up to rounding."""
    b = rhs((48, 48), seed=7)

    @jax.jit
    def with_bounds(b):
        lmin, lmax = sx.estimate_spectrum(poisson_2d, b, steps=20)
        return sx.pcg(poisson_2d, b, method="s_step", s=4, spectrum=(0.9 * lmin, 1.1 * lmax))

    given, estimated = with_bounds(b), sx.pcg(poisson_2d, b, method="s_step", s=4)
    assert bool(given.converged) and bool(estimated.converged)
    assert abs(int(given.iterations) - int(estimated.iterations)) <= 4
    assert rel_err(given.x, estimated.x) < 1e-6


def test_preconditioned_s_step_is_preconditioned_cg():
    """With a Jacobi preconditioner on a badly scaled SPD matrix: the steps of
    preconditioned CG (within one block), far fewer than without."""
    A = random_spd(60, seed=8)
    scale = np.logspace(0, 3, 60)
    A = jnp.asarray(scale[:, None] * A * scale[None, :])
    b = rhs(60, seed=9)
    M = sx.jacobi(jnp.diagonal(A))
    pcg = sx.pcg(lambda x: A @ x, b, precond=M, rtol=1e-10)
    sstep = sx.pcg(lambda x: A @ x, b, precond=M, rtol=1e-10, method="s_step", s=4)
    plain = sx.pcg(lambda x: A @ x, b, rtol=1e-10, method="s_step", s=4, max_steps=2000)
    assert bool(sstep.converged), sstep.message
    assert int(sstep.iterations) <= int(pcg.iterations) + 8
    assert int(sstep.iterations) < int(plain.iterations)


def high_contrast(x, contrast=1e6):
    """`-div(k grad u)`, k = 1 on the left half and 1e-6 on the right: SPD,
    condition number 2e8 on 32 x 32 (as `benchmarks/problems.high_contrast`)."""
    n = x.shape[1]
    k = jnp.where(jnp.arange(n + 1) < (n + 1) // 2, 1.0, 1.0 / contrast)
    kx = jnp.where(jnp.arange(n) < n // 2, 1.0, 1.0 / contrast)[None, :]
    xp = jnp.pad(x, 1)
    return (k[None, 1:] * (x - xp[1:-1, 2:]) + k[None, :-1] * (x - xp[1:-1, :-2])
            + kx * (2 * x - xp[2:, 1:-1] - xp[:-2, 1:-1]))


@pytest.mark.parametrize("basis", ["chebyshev", "newton", "monomial"])
@pytest.mark.parametrize("s", [4, 8])
def test_ill_conditioned_reports_honestly(s, basis):
    """Condition number 2e8: whatever each basis attains (standard CG: 1798
    steps), `converged` holds only when the true residual meets the
    tolerance, and a miss comes with a status that says so."""
    b = jnp.ones((32, 32))
    sol = sx.pcg(high_contrast, b, rtol=1e-8, method="s_step", s=s, basis=basis,
                 max_steps=4000)
    rel = true_rel_residual(high_contrast, b, sol.x)
    if bool(sol.converged):
        assert rel <= 1e-8 * (1 + 1e-6)
    else:
        assert Status(int(sol.status)) in (Status.STAGNATION, Status.BREAKDOWN,
                                           Status.MAX_STEPS), sol.message
        assert rel > 1e-8


def test_monomial_basis_loses_rank_where_chebyshev_does_not():
    """s = 12 on Poisson 64^2: the monomial basis's Gram matrix loses rank
    (directions dropped, the solve slows or stops short); Chebyshev converges."""
    b = rhs((64, 64), seed=11)
    cheb = sx.pcg(poisson_2d, b, rtol=1e-8, method="s_step", s=12)
    mono = sx.pcg(poisson_2d, b, rtol=1e-8, method="s_step", s=12, basis="monomial",
                  max_steps=3000)
    assert bool(cheb.converged), cheb.message
    assert not bool(mono.converged) or int(mono.iterations) > 1.3 * int(cheb.iterations)


def test_s_step_residual_replacement():
    b = rhs((64, 64), seed=12)
    sol = sx.pcg(poisson_2d, b, rtol=1e-10, method="s_step", s=4, residual_replacement=5)
    assert bool(sol.converged), sol.message
    assert true_rel_residual(poisson_2d, b, sol.x) <= 1e-10


def test_s_step_statuses():
    b = rhs(30, seed=13)
    indefinite = jnp.asarray(np.diag(np.linspace(-1.0, 2.0, 30)))
    sol = sx.pcg(lambda x: indefinite @ x, b, method="s_step", s=4)
    assert Status(int(sol.status)) == Status.INDEFINITE
    sol = sx.pcg(lambda x: 2.0 * x, b, method="s_step", s=4, max_steps=0)
    assert Status(int(sol.status)) == Status.MAX_STEPS
    sol = sx.pcg(lambda x: 2.0 * x, jnp.zeros(30), method="s_step")
    assert bool(sol.converged) and int(sol.iterations) == 0
    # an invariant Krylov space of dimension 2 < s: directions drop, still exact
    sol = sx.pcg(lambda x: jnp.where(jnp.arange(30) < 15, 1.0, 3.0) * x, b,
                 method="s_step", s=4)
    assert bool(sol.converged) and int(sol.iterations) == 4, sol.message


def test_s_step_history_is_per_outer_step():
    b = rhs((32, 32), seed=14)
    sol = sx.pcg(poisson_2d, b, method="s_step", s=4, record_history=True, max_steps=400)
    h = np.asarray(sol.history)
    k = int(sol.iterations)
    assert h.shape == (401,)
    assert np.all(np.isfinite(h[0:k + 1:4])) and np.all(np.isnan(h[1:k:4]))
    assert h[0] == pytest.approx(float(jnp.linalg.norm(b)))


@pytest.mark.parametrize("bad, error", [
    (dict(s=0), ValueError), (dict(s=2.0), TypeError), (dict(basis="legendre"), ValueError),
    (dict(spectrum=3.0), TypeError), (dict(spectrum=(2.0, 1.0)), ValueError),
    (dict(spectrum=(-1.0, 1.0)), ValueError), (dict(spectrum=(1j, 2.0)), TypeError)])
def test_s_step_bad_options(bad, error):
    with pytest.raises(error):
        sx.pcg(lambda x: 2 * x, jnp.ones(8), method="s_step", **bad)


def test_s_step_options_need_s_step():
    with pytest.raises(ValueError, match="s_step"):
        sx.pcg(lambda x: 2 * x, jnp.ones(8), s=8)
    with pytest.raises(ValueError, match="s_step"):
        sx.pcg(lambda x: 2 * x, jnp.ones(8), method="pipelined", spectrum=(1.0, 2.0))


def test_leja_order():
    nodes = np.cos((2 * np.arange(6) + 1) * np.pi / 12)
    ordered = leja_order(nodes)
    assert sorted(ordered) == sorted(nodes)
    assert abs(ordered[0]) == np.max(np.abs(nodes))
    # each next node maximizes the product of distances to those before
    for k in range(1, 6):
        rest = [x for x in nodes if x not in ordered[:k]]
        dist = [np.prod(np.abs(x - ordered[:k])) for x in rest]
        assert np.prod(np.abs(ordered[k] - ordered[:k])) == pytest.approx(max(dist))


@pytest.mark.parametrize("s", [4, 8])
def test_float32_first_block_does_not_overflow(s):
    """A 128^2 Laplacian with spacing 1/128 (lambda_max 1.3e5) in float32: the
    first, unscaled block's Gram matrix (~lambda_max^(2s-1)) overflowed and
    the solve returned NONFINITE after 0 steps (a TPU's emulated float64 too).
    It is retried on a Rayleigh-quotient interval: converged within 2x CG's
    iterations (CG: 242 at rtol 1e-4)."""
    n = 128
    A = sx.diffusion_operator(jnp.ones((n, n), jnp.float32), spacing=1.0 / n)
    b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    cg = sx.pcg(A, b, rtol=1e-4)
    sol = sx.pcg(A, b, rtol=1e-4, method="s_step", s=s)
    assert sol.status == Status.CONVERGED, sol.message
    assert int(sol.iterations) <= 2 * int(cg.iterations)
    r = np.asarray(b, np.float64) - np.asarray(A.astype(jnp.float64)(sol.x.astype(jnp.float64)))
    assert np.linalg.norm(r) <= 1e-4 * np.linalg.norm(np.asarray(b, np.float64))
