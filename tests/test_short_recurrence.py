"""What is particular to BiCGStab (one synchronization), IDR(s) and MINRES;
the generic behaviour (pytrees, shardings, shard_map, vmap, grad, dtypes, bad
input, counts) is tested for every entry of `helpers.SOLVERS`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse.linalg as spl
from helpers import (
    convection_diffusion,
    poisson_2d,
    random_nonsymmetric,
    random_spd,
    rel_err,
    rhs,
)

import solvax as sx
from solvax import Status


def saddle_point(n=120, m=40, seed=0):
    """`[[K, B^T], [B, 0]]` with K SPD and B of full rank: symmetric indefinite."""
    rng = np.random.default_rng(seed)
    K = random_spd(n, seed=seed)
    B = rng.standard_normal((m, n))
    return np.block([[K, B.T], [B, np.zeros((m, m))]])


# ------------------------------------------------------------------ BiCGStab
@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.float32])
def test_one_sync_bicgstab_matches_the_standard_recurrence(dtype):
    """Same method, other recurrences: the same iterates up to rounding, so
    the same step count (give or take rounding) and the requested accuracy."""
    A = jnp.asarray(random_nonsymmetric(60, seed=2, dtype=dtype))
    b = rhs(60, seed=3, dtype=dtype)
    rtol = 1e-5 if dtype == np.float32 else 1e-10
    sols = {m: sx.bicgstab(lambda x: A @ x, b, rtol=rtol, method=m)
            for m in ("standard", "one_sync")}
    ref = np.linalg.solve(np.asarray(A, np.complex128), np.asarray(b, np.complex128))
    for sol in sols.values():
        assert bool(sol.converged)
        assert rel_err(sol.x, ref) < (1e-3 if dtype == np.float32 else 1e-8)
    assert abs(int(sols["one_sync"].iterations) - int(sols["standard"].iterations)) <= 2


def test_one_sync_bicgstab_on_convection_diffusion():
    """The attainable accuracy of the expanded products: 1e-10 on a 48^2
    convection-diffusion problem, within 15% of the standard step count."""
    mv, b = convection_diffusion(10.0), rhs((48, 48))
    its = {}
    for method in ("standard", "one_sync"):
        sol = sx.bicgstab(mv, b, rtol=1e-10, method=method)
        assert bool(sol.converged), (method, sol.message)
        its[method] = int(sol.iterations)
    assert its["one_sync"] <= 1.15 * its["standard"], its


def test_one_sync_bicgstab_stops_at_its_rounding_level():
    """Asked for more than any recurrence attains (rtol 1e-16; standard
    BiCGStab stops at 1e-14 here), it stops at the floor (FLOOR or
    STAGNATION) with a finite x
    instead of drifting on (before its restarts it reached Inf after 3000
    steps at rtol 1e-14); restarted from the true residual where its
    expansions drift, it now reaches 1e-15 (6e-11 before)."""
    mv, b = convection_diffusion(10.0), rhs((64, 64))
    sol = sx.bicgstab(mv, b, rtol=1e-16, method="one_sync", max_steps=3000)
    assert int(sol.status) in (Status.FLOOR, Status.STAGNATION) and int(sol.iterations) < 600
    assert np.all(np.isfinite(np.asarray(sol.x)))
    assert float(sol.residual_norm) < 1e-13 * float(jnp.linalg.norm(b))


def test_one_sync_bicgstab_float32_reaches_standard_floor():
    """Float32 Poisson 128^2 (spacing 1/128, rtol 1e-4): the one-sync
    recurrences broke down (BREAKDOWN at 1e-3 to 1.1 ||b||, the TPU run too)
    where standard BiCGStab converges; restarted from the true residual (the
    new shadow) they converge on JAX 0.10.2 (181 steps) and stop as
    STAGNATION at 7.9e-4 on 0.4.38 (rounding differs), never BREAKDOWN; with
    b = ones they stop at float32's floor (STAGNATION), as standard BiCGStab
    does."""
    n = 128
    A = sx.diffusion_operator(jnp.ones((n, n), jnp.float32), spacing=1.0 / n)
    b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    for precond in (None, sx.jacobi(A.diagonal())):
        sol = sx.bicgstab(A, b, rtol=1e-4, method="one_sync", precond=precond)
        assert int(sol.status) in (Status.CONVERGED, Status.FLOOR, Status.STAGNATION), sol.message
        assert float(sol.residual_norm) <= 1e-3 * float(jnp.linalg.norm(b))
    sol = sx.bicgstab(A, jnp.ones((n, n), jnp.float32), rtol=1e-4, method="one_sync")
    assert int(sol.status) in (Status.FLOOR, Status.STAGNATION)
    assert float(sol.residual_norm) < 1e-2 * n


def _lanczos_breakdown_after_one_step():
    """`A = A0 + theta E` with `theta` bisected (to the last bit) so that
    BiCGStab's second step has `<r0, A p_1> = 0`: its Lanczos part breaks
    down after one step of progress (three such roots; one taken)."""
    rng = np.random.default_rng(3)
    A0 = rng.standard_normal((6, 6)) + 4 * np.eye(6)
    E, b = rng.standard_normal((6, 6)), rng.standard_normal(6)
    return A0 - 1.7663901319322246 * E, b


def test_bicgstab_restarts_after_a_lanczos_breakdown():
    """The shadow residual replaced by the current one (no extra matvec or
    reduction): it converges where it used to stop as BREAKDOWN after one
    step (jax.scipy divides by the vanished <r0, v> and goes on with a step
    of rounding). The derivative (a transposed solve) matches the dense one."""
    A, b = _lanczos_breakdown_after_one_step()
    Aj, bj = jnp.asarray(A), jnp.asarray(b)
    sol = jax.jit(lambda b: sx.bicgstab(lambda x: Aj @ x, b, rtol=1e-12))(bj)
    assert int(sol.status) == Status.CONVERGED, sol.message
    assert rel_err(sol.x, np.linalg.solve(A, b)) < 1e-10
    w = np.arange(1.0, 7.0)
    g = jax.grad(lambda b: jnp.sum(w * sx.bicgstab(lambda x: Aj @ x, b, rtol=1e-12).x))(bj)
    assert rel_err(g, np.linalg.solve(A.T, w)) < 1e-8
    # the one-sync recurrences do not restart: their expanded products do not
    # vanish exactly, and the rounding level they reach is reported
    one = sx.bicgstab(lambda x: Aj @ x, bj, rtol=1e-12, method="one_sync")
    assert int(one.status) in (Status.BREAKDOWN, Status.STAGNATION), one.message


def test_one_sync_bicgstab_breakdown_is_reported():
    S = np.triu(np.random.default_rng(1).standard_normal((16, 16)), 1)
    S = jnp.asarray(S - S.T)
    sol = sx.bicgstab(lambda x: S @ x, rhs(16), method="one_sync")
    assert int(sol.status) == Status.BREAKDOWN and int(sol.iterations) == 0


def test_bicgstab_method_is_checked():
    with pytest.raises(ValueError, match="`method` must be one of 'standard', 'one_sync'"):
        sx.bicgstab(lambda x: x, jnp.ones(4), method="pipelined")


# --------------------------------------------------------------------- IDR(s)
@pytest.mark.parametrize("s", [1, 2, 4, 8])
def test_idrs_solves_a_nonsymmetric_system(s):
    A = random_nonsymmetric(50, seed=5)
    b = rhs(50)
    sol = sx.idrs(lambda x: jnp.asarray(A) @ x, b, s=s, rtol=1e-11)
    assert bool(sol.converged), sol.message
    assert rel_err(sol.x, np.linalg.solve(A, np.asarray(b))) < 1e-9
    # at most n + n/s matvecs in exact arithmetic; a little rounding slack
    assert int(sol.iterations) <= 1.2 * (50 + 50 / s)


def test_idrs_larger_s_needs_fewer_matvecs():
    """The point of s: on convection-diffusion 48^2, IDR(8) takes fewer
    matvecs than IDR(1) (measured: 302 and 376)."""
    mv, b = convection_diffusion(10.0), rhs((48, 48))
    its = {s: int(sx.idrs(mv, b, s=s, rtol=1e-8).iterations) for s in (1, 8)}
    assert its[8] < its[1], its


def test_idrs_shadow_space_is_deterministic_and_keyed():
    """Same key, same iterates (bit for bit); another key, another shadow space
    (other iterates) that also converges; a typed key works like its data."""
    A = jnp.asarray(random_nonsymmetric(40, seed=7))
    b = rhs(40)
    f = jax.jit(lambda b, key=0: sx.idrs(lambda x: A @ x, b, key=key, rtol=1e-10).x,
                static_argnums=1)
    assert np.array_equal(np.asarray(f(b, 0)), np.asarray(f(b, 0)))
    other = sx.idrs(lambda x: A @ x, b, key=1, rtol=1e-10)
    assert bool(other.converged) and not np.array_equal(np.asarray(other.x), np.asarray(f(b, 0)))
    typed = sx.idrs(lambda x: A @ x, b, key=jax.random.key(3), rtol=1e-10)
    raw = sx.idrs(lambda x: A @ x, b, key=jax.random.key_data(jax.random.key(3)), rtol=1e-10)
    assert np.array_equal(np.asarray(typed.x), np.asarray(raw.x))


def test_idrs_shadow_space_keeps_leaf_shapes():
    from solvax._krylov.idrs import shadow_space

    b = {"a": jnp.ones((3, 5)), "c": jnp.ones(7, jnp.complex64)}
    P = shadow_space(b, 4, jax.random.PRNGKey(0))
    assert P["a"].shape == (4, 3, 5) and P["a"].dtype == jnp.float64
    assert P["c"].shape == (4, 7) and P["c"].dtype == jnp.complex64
    # normalized: each shadow vector has norm about 1 over all leaves
    norms = np.sqrt(sum(np.sum(np.abs(np.asarray(v).reshape(4, -1)) ** 2, axis=1)
                        for v in P.values()))
    assert np.all((norms > 0.3) & (norms < 2.0))


def test_idrs_bad_options():
    b = jnp.ones(4)
    with pytest.raises(ValueError, match="`s` must be >= 1"):
        sx.idrs(lambda x: x, b, s=0)
    with pytest.raises(TypeError, match="`s` must be a Python int"):
        sx.idrs(lambda x: x, b, s=2.0)
    with pytest.raises(ValueError, match="`angle` must be in"):
        sx.idrs(lambda x: x, b, angle=1.5)
    with pytest.raises(TypeError, match="`key` must be"):
        sx.idrs(lambda x: x, b, key="seed")
    with pytest.raises(TypeError, match="`key` must be concrete"):
        jax.jit(lambda k: sx.idrs(lambda x: x, b, key=k).x)(jax.random.PRNGKey(0))


def test_idrs_angle_safeguard_is_used():
    """kappa = 0.7 enlarges omega where t and r are nearly orthogonal: other
    iterates, same answer."""
    mv, b = convection_diffusion(10.0), rhs((48, 48))  # measured: 206 and 216 matvecs
    plain = sx.idrs(mv, b, rtol=1e-10)
    guarded = sx.idrs(mv, b, rtol=1e-10, angle=0.7)
    assert bool(plain.converged) and bool(guarded.converged)
    assert int(plain.iterations) != int(guarded.iterations)
    assert rel_err(plain.x, guarded.x) < 1e-8


# --------------------------------------------------------------------- MINRES
def _scipy_steps_to(A, b, tol):
    """The first step at which scipy's MINRES iterate meets the true relative
    residual `tol` (its own stopping test is a backward error, so its final
    step is not comparable)."""
    steps = []

    def callback(x):
        steps.append(np.linalg.norm(b - A @ x) <= tol * np.linalg.norm(b))

    spl.minres(A, b, rtol=1e-14, maxiter=10 * len(b), callback=callback)
    return steps.index(True) + 1


@pytest.mark.parametrize("rtol", [1e-6, 1e-10])
def test_minres_matches_scipy_on_a_saddle_point_system(rtol):
    S = saddle_point()
    b = np.random.default_rng(1).standard_normal(len(S))
    sol = sx.minres(lambda x: jnp.asarray(S) @ x, jnp.asarray(b), rtol=rtol)
    assert bool(sol.converged), sol.message
    assert abs(int(sol.iterations) - _scipy_steps_to(S, b, rtol)) <= 2
    assert rel_err(sol.x, np.linalg.solve(S, b)) < 1e3 * rtol


def test_minres_on_spd_needs_about_cg_steps():
    b = rhs((32, 32))
    m, c = sx.minres(poisson_2d, b, rtol=1e-10), sx.pcg(poisson_2d, b, rtol=1e-10)
    assert bool(m.converged) and abs(int(m.iterations) - int(c.iterations)) <= 0.1 * int(
        c.iterations)


def test_minres_complex_hermitian_indefinite():
    H = jnp.asarray(random_spd(30, dtype=np.complex128) - 1.5 * np.eye(30))
    b = rhs(30, dtype=np.complex128)
    sol = sx.minres(lambda x: H @ x, b, rtol=1e-12)
    assert bool(sol.converged) and rel_err(sol.x, np.linalg.solve(H, b)) < 1e-9


def test_minres_preconditioned_meets_the_true_residual():
    """With M != I the QR's estimate is `||r||_M`; the true 2-norm decides, the
    same Lanczos process going on after a miss."""
    S = saddle_point()
    b = jnp.asarray(np.random.default_rng(2).standard_normal(len(S)))
    d = jnp.asarray(np.where(np.diag(S) == 0, 1e-2, np.abs(np.diag(S))))  # far from I
    sol = sx.minres(lambda x: jnp.asarray(S) @ x, b, rtol=1e-10, precond=lambda v: v / d)
    assert bool(sol.converged), sol.message
    assert float(jnp.linalg.norm(b - jnp.asarray(S) @ sol.x)) <= 1e-10 * float(
        jnp.linalg.norm(b))


def test_minres_indefinite_preconditioner():
    S = saddle_point()
    b = jnp.ones(len(S))
    flip = jnp.where(jnp.arange(len(S)) < 5, -1.0, 1.0)
    sol = sx.minres(lambda x: jnp.asarray(S) @ x, b, precond=lambda v: flip * v)
    assert int(sol.status) == Status.INDEFINITE and "MINRES" in sol.message


def test_minres_singular_inconsistent_is_a_least_squares_solution():
    """diag(1..19, 0) with b = 1: no solution. MINRES stops as BREAKDOWN with a
    least-squares solution: A^T (b - A x) = 0 and ||b - A x|| = 1."""
    A = np.diag(np.r_[np.arange(1, 20.0), 0.0])
    sol = sx.minres(lambda x: jnp.asarray(A) @ x, jnp.ones(20))
    assert int(sol.status) == Status.BREAKDOWN and "least-squares" in sol.message
    r = np.ones(20) - A @ np.asarray(sol.x)
    assert np.isclose(float(sol.residual_norm), 1.0, rtol=1e-8)
    assert np.linalg.norm(A.T @ r) < 1e-8
    assert np.all(np.isfinite(np.asarray(sol.x)))


@pytest.mark.parametrize("rtol", [0.5, 0.1])
def test_minres_loose_tolerance_on_spd_is_no_breakdown(rtol):
    """The least-squares test is not the tolerance: with `rtol=0.5` on a
    Poisson system `||A r|| / (||A|| ||r||)` fell below it after 2 steps and
    MINRES called the SPD system singular (BREAKDOWN, residual 0.9)."""
    b = jnp.ones((16, 16))
    sol = sx.minres(poisson_2d, b, rtol=rtol)
    assert int(sol.status) == Status.CONVERGED, sol.message
    assert float(sol.residual_norm) <= rtol * float(jnp.linalg.norm(b))


def test_minres_singular_consistent_converges():
    A = np.diag(np.r_[np.arange(1, 20.0), 0.0])
    b = jnp.ones(20).at[-1].set(0.0)
    sol = sx.minres(lambda x: jnp.asarray(A) @ x, b, rtol=1e-12)
    assert bool(sol.converged)


def test_minres_history_is_the_qr_estimate():
    b = rhs((12, 12))
    sol = sx.minres(poisson_2d, b, rtol=1e-10, record_history=True)
    h, k = np.asarray(sol.history), int(sol.iterations)
    assert np.isclose(h[0], float(jnp.linalg.norm(b)), rtol=1e-12)
    assert np.all(np.diff(h[: k + 1]) <= 1e-12 * h[0])  # MINRES residuals never grow
    assert np.all(np.isfinite(h[: k + 1])) and np.all(np.isnan(h[k + 1:]))
    assert h[k] <= 1e-10 * h[0] * 1.01


@pytest.mark.parametrize("name", ["idrs", "bicgstab_one_sync", "minres"])
def test_new_methods_in_float32(name):
    from helpers import SOLVERS

    A = random_spd(40, dtype=np.float32) if name == "minres" else random_nonsymmetric(
        40, dtype=np.float32)
    b = rhs(40, dtype=np.float32)
    sol = SOLVERS[name].solve(lambda x: jnp.asarray(A) @ x, b)
    assert bool(sol.converged) and sol.x.dtype == jnp.float32
    assert rel_err(sol.x, np.linalg.solve(A.astype(np.float64), np.asarray(b, np.float64))) < 1e-3


def test_idrs_reduction_per_matvec_inside_shard_map():
    """s + 1 psums per cycle: one per matvec, each of s + 1 (or s + 3) scalars."""
    from helpers import count_primitives, mesh
    from jax.sharding import PartitionSpec as P

    f = sx.shard_map(lambda b: sx.idrs(lambda x: 2.0 * x, b, s=3, axis_name="i").x,
                     mesh=mesh(8), in_specs=P("i"), out_specs=P("i"))
    jaxpr = jax.make_jaxpr(f)(jnp.ones(64))
    # the scale's pmax, the setup's psum, 4 in the cycle, the confirmation's
    # (`P^H r` of the true residual after a round), the final check's
    assert count_primitives(jaxpr, "psum") == 1 + 4 + 1 + 1
    assert rel_err(f(jnp.ones(64)), np.full(64, 0.5)) < 1e-12



def test_idrs_default_s_counts():
    """IDR(4), the default (the registry runs s = 2): 8 collectives, 5 per
    cycle of 5 matvecs and one per round (the confirmation on the true
    residual, in the loop around the cycles), 16 for the adjoint (the
    table's row)."""
    from helpers import mesh, put

    m = mesh(8)
    d = put(jnp.asarray(2.0 + np.random.default_rng(0).random(256)), m, "i")
    b = put(rhs(256), m, "i")

    def f(d, b):
        return sx.idrs(lambda x: d * x, b).x

    primal = sx.count_collectives(f, d, b)
    adjoint = sx.count_collectives(jax.grad(lambda d, b: jnp.sum(f(d, b) ** 2), (0, 1)), d, b)
    assert (primal.total, primal.per_iteration, adjoint.total) == (8, 6, 16), str(primal)
    assert primal.step_count("all-reduce") == 5, str(primal)
