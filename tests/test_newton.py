"""Newton–Krylov: converged means `||F(u)||` meets the tolerance (measured on
`F` again here), the line search shortens an overshooting step, every status
for its cause, every inner solver, preconditioners fixed and rebuilt, roots
differentiated by the implicit function theorem (against finite differences),
batches, sharded state (no all-gather; a step's collectives are its linear
solve's and one norm), bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import solvax as sx
from solvax import Status

N = 16
H = 1.0 / (N + 1)


def laplacian(u):
    up = jnp.pad(u, 1)
    return (4 * u - up[2:, 1:-1] - up[:-2, 1:-1] - up[1:-1, 2:] - up[1:-1, :-2]) / H**2


def bratu(lam=6.0):
    return lambda u: laplacian(u) - lam * jnp.exp(u)


def bratu_multigrid(lam=6.0):
    return lambda u: sx.multigrid(sx.diffusion_operator(1.0, shape=u.shape, spacing=H,
                                                        shift=-lam * jnp.exp(u)))


def overshooting(c=20.0, f=100.0):
    """`-div((1 + u^2) grad u) + c du/dx - f`: from 0 the full step overshoots."""
    def F(u):
        up = jnp.pad(u, 1)
        k = 1 + up**2
        kx, ky = 0.5 * (k[1:, 1:-1] + k[:-1, 1:-1]), 0.5 * (k[1:-1, 1:] + k[1:-1, :-1])
        gx, gy = (up[1:, 1:-1] - up[:-1, 1:-1]) / H, (up[1:-1, 1:] - up[1:-1, :-1]) / H
        div = (kx[1:] * gx[1:] - kx[:-1] * gx[:-1] + ky[:, 1:] * gy[:, 1:]
               - ky[:, :-1] * gy[:, :-1]) / H
        return -div + c * (u - up[:-2, 1:-1]) / H - f
    return F


U0 = jnp.zeros((N, N))


def converged_for_real(F, sol, rtol, u0=U0):
    """CONVERGED and `||F(u)|| <= rtol ||F(u0)||`, both norms computed here."""
    assert int(sol.status) == Status.CONVERGED, sol.message
    assert float(jnp.linalg.norm(F(sol.u))) <= rtol * float(jnp.linalg.norm(F(u0)))


@pytest.mark.parametrize("solver", ["bicgstab", "gmres", "idrs", "pcg", "minres"])
def test_every_inner_solver_solves_bratu(solver):
    F = bratu()
    sol = jax.jit(lambda u0: sx.newton_krylov(F, u0, solver=solver, rtol=1e-10))(U0)
    converged_for_real(F, sol, 1e-10)
    assert 3 <= int(sol.iterations) <= 12 and int(sol.linear_iterations) > 0
    history = np.asarray(sol.history)
    k = int(sol.iterations)
    assert np.isclose(history[k], float(sol.residual_norm)) and np.all(np.isnan(history[k + 1:]))
    assert np.all(np.diff(history[:k + 1]) < 0)  # the line search keeps ||F|| decreasing


def test_the_line_search_shortens_an_overshooting_step():
    """Full Newton steps raise `||F||` (5x on the first step); with the line
    search every accepted step lowers it, and both reach the root."""
    F = overshooting()
    full = sx.newton_krylov(F, U0, rtol=1e-9, line_search=False)
    searched = sx.newton_krylov(F, U0, rtol=1e-9)
    converged_for_real(F, full, 1e-9)
    converged_for_real(F, searched, 1e-9)
    assert float(full.history[1]) > 2 * float(full.history[0])
    steps = int(searched.iterations)
    assert np.all(np.diff(np.asarray(searched.history[:steps + 1])) < 0)


def test_multigrid_rebuilt_every_step_and_every_other():
    F = bratu()
    for refresh in (1, 2):
        sol = jax.jit(lambda u0, r=refresh: sx.newton_krylov(
            F, u0, solver="pcg", precond_builder=bratu_multigrid(), refresh=r,
            rtol=1e-10))(U0)
        converged_for_real(F, sol, 1e-10)
        assert int(sol.iterations) <= 8
        assert int(sol.linear_iterations) <= 5 * int(sol.iterations)


def test_a_fixed_preconditioner_and_a_jacobi_builder():
    F = bratu()
    fixed = sx.jacobi(jnp.full((N, N), 4 / H**2))
    built = lambda u: sx.jacobi(4 / H**2 - 6.0 * jnp.exp(u))  # noqa: E731
    for options in (dict(precond=fixed), dict(precond_builder=built, refresh=3)):
        converged_for_real(F, sx.newton_krylov(F, U0, rtol=1e-10, **options), 1e-10)


@pytest.mark.parametrize("forcing", ["eisenstat_walker", 0.5, 1e-3])
def test_forcing_terms(forcing):
    F = bratu(6.7)   # near the turning point (6.81)
    sol = sx.newton_krylov(F, U0, rtol=1e-10, forcing=forcing)
    converged_for_real(F, sol, 1e-10)


def test_float32_stops_at_its_rounding_level():
    """float32 Bratu: to rtol 1e-4 it converges; at the default (1.2e-5) ||F||
    reaches its rounding level first, and the solve stops there with
    LINE_SEARCH (steps that left ||F|| unchanged were accepted until
    `max_steps` before the line search asked for a strict decrease)."""
    F, u0 = bratu(), U0.astype(jnp.float32)
    sol = sx.newton_krylov(F, u0, rtol=1e-4)
    assert int(sol.status) == Status.CONVERGED and sol.u.dtype == jnp.float32
    sol = sx.newton_krylov(F, u0)
    assert int(sol.status) in (Status.CONVERGED, Status.LINE_SEARCH), sol.message
    assert int(sol.iterations) < 20


def test_no_root_stops_with_a_status_in_a_batch():
    """Bratu has no solution past 6.81: under `vmap` the other members converge."""
    def solve(lam):
        return sx.newton_krylov(bratu(lam), U0, precond_builder=bratu_multigrid(lam))

    sol = jax.vmap(solve)(jnp.array([1.0, 6.0, 7.5]))
    status = list(np.asarray(sol.status))
    assert status[:2] == [Status.CONVERGED, Status.CONVERGED]
    # no root: the steps stop decreasing ||F|| (LINE_SEARCH) or run out
    # (MAX_STEPS), which of the two depends on the inner solves' path
    # (LINE_SEARCH after 28 steps with a 4/3-damped Jacobi multigrid,
    # MAX_STEPS after 50 with 8/5), never a root
    assert status[2] in (Status.LINE_SEARCH, Status.MAX_STEPS) and sol.residual_norm[2] > 1


def test_a_pytree_state():
    """Two unknowns coupled through `F`: a dict state, each leaf its own shape."""
    def F(u):
        return {"a": u["a"] ** 3 + u["b"][0] - 2.0, "b": u["b"] - jnp.array([1.0, 2.0])}

    u0 = {"a": jnp.ones(3), "b": jnp.zeros(2)}
    sol = sx.newton_krylov(F, u0, solver="gmres", rtol=1e-12)
    assert int(sol.status) == Status.CONVERGED
    np.testing.assert_allclose(sol.u["a"], 1.0, atol=1e-10)
    np.testing.assert_allclose(sol.u["b"], [1.0, 2.0], atol=1e-10)


def test_statuses_for_each_cause():
    F = bratu()
    assert int(sx.newton_krylov(F, U0, max_steps=1).status) == Status.MAX_STEPS
    assert int(sx.newton_krylov(F, U0, max_steps=0).status) == Status.MAX_STEPS
    # u^2 + 1 has no real root: the steps stop reducing |F| (line search), or
    # the Jacobian vanishes (linear solve); never CONVERGED, never NaN
    sol = sx.newton_krylov(lambda u: u**2 + 1, jnp.array([1.0]), max_steps=100)
    assert int(sol.status) in (Status.LINE_SEARCH, Status.LINEAR_SOLVE), sol.message
    assert np.all(np.isfinite(sol.u)) and float(sol.residual_norm) >= 1.0
    # a full step into overflow: NONFINITE without the line search, shortened with it
    blow = lambda u: jnp.exp(u) - 1e300 * (1 + 0 * u)  # noqa: E731
    assert int(sx.newton_krylov(blow, jnp.zeros(2), line_search=False).status) == Status.NONFINITE
    assert int(sx.newton_krylov(lambda u: u * jnp.nan, jnp.ones(2)).status) == Status.NONFINITE
    # a zero Jacobian: the linear solve fails
    sol = sx.newton_krylov(lambda u: 0 * u + 1, jnp.ones(2))
    assert int(sol.status) == Status.LINEAR_SOLVE and int(sol.linear_status) != Status.CONVERGED
    # a traced invalid tolerance
    sol = jax.jit(lambda r: sx.newton_krylov(F, U0, rtol=r))(-1.0)
    assert int(sol.status) == Status.INVALID_TOLERANCE
    # the messages speak of F, not of a linear system's b
    assert "||F(u)||" in sx.newton_krylov(F, U0).message
    assert "max_steps" in sx.newton_krylov(F, U0, max_steps=1).message


def test_root_derivative_matches_finite_differences():
    """d/dλ of the mean of the Bratu root: `grad`, `jvp` and `vmap`, against a
    central difference (the roots solved to 1e-13)."""
    def mean_root(lam, **options):
        sol = sx.newton_krylov(bratu(lam), U0, rtol=1e-13, solver="gmres", **options)
        return jnp.mean(sol.u)

    lam, eps = 5.0, 1e-4
    central = (mean_root(lam + eps) - mean_root(lam - eps)) / (2 * eps)
    g = jax.jit(jax.grad(mean_root))(lam)
    np.testing.assert_allclose(g, central, rtol=1e-6)
    _, tangent = jax.jvp(mean_root, (lam,), (1.0,))
    np.testing.assert_allclose(tangent, central, rtol=1e-6)
    grads = jax.vmap(jax.grad(mean_root))(jnp.array([lam, 4.0]))
    np.testing.assert_allclose(grads[0], central, rtol=1e-6)
    # with the multigrid preconditioner (transposed by linear_transpose)
    g_mg = jax.grad(lambda lam: jnp.mean(sx.newton_krylov(
        bratu(lam), U0, rtol=1e-13, solver="pcg", precond_builder=bratu_multigrid(lam)).u))(lam)
    np.testing.assert_allclose(g_mg, central, rtol=1e-6)


def test_the_derivative_of_a_failed_root_is_nan():
    g = jax.grad(lambda lam: jnp.mean(sx.newton_krylov(bratu(lam), U0, max_steps=1).u))(6.0)
    assert np.isnan(g)
    g = jax.grad(lambda lam: jnp.mean(sx.newton_krylov(
        bratu(lam), U0, max_steps=1, failed_derivative="keep").u))(6.0)
    assert np.isfinite(g)


def test_sharded_state_no_all_gather_and_a_step_is_its_solve_plus_one_norm():
    """`u` sharded over 8 devices under `jit`: the Newton program's all-reduces
    are those of its linear solve, one for ||F(u0)|| and one per step length
    tried (the line search's norm); no all-gather; the same root as on one
    device."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    lam = jax.device_put(jnp.full((N, N), 6.0), NamedSharding(mesh, P("i", None)))
    u0 = jax.device_put(U0, NamedSharding(mesh, P("i", None)))

    def F(u, lam):
        return laplacian(u) - lam * jnp.exp(u)

    def newton(u0, lam):
        return sx.newton_krylov(lambda u: F(u, lam), u0, rtol=1e-10).u

    def linear(u0, lam):  # the inner solve of a step, alone (its status read, as Newton does)
        _, J = jax.linearize(lambda u: F(u, lam), u0)
        return sx.bicgstab(J, -F(u0, lam), rtol=0.5, atol=0.0, max_steps=100)

    report = sx.count_collectives(newton, u0, lam)
    solve = sx.count_collectives(linear, u0, lam)
    assert report.count("all-gather") == 0
    assert report.count("all-reduce") == solve.count("all-reduce") + 2
    u = jax.jit(newton)(u0, lam)
    assert u.sharding.spec == P("i", None)
    np.testing.assert_allclose(u, jax.jit(newton)(U0, jnp.full((N, N), 6.0)), atol=1e-10)


def test_inside_shard_map_with_axis_name():
    """A halo-exchanging `F` inside `shard_map`: the norms reduce over the
    axis (without `axis_name` it is refused: each shard would decide alone)."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("i",))

    def local_F(u):  # rows split over "i"; halos by ppermute
        n = jax.lax.psum(1, "i")
        down = jax.lax.ppermute(u[-1:], "i", [(k, k + 1) for k in range(n - 1)])
        up = jax.lax.ppermute(u[:1], "i", [(k + 1, k) for k in range(n - 1)])
        ext = jnp.concatenate([down, u, up])
        ext = jnp.pad(ext, ((0, 0), (1, 1)))
        lap = (4 * u - ext[2:, 1:-1] - ext[:-2, 1:-1] - ext[1:-1, 2:] - ext[1:-1, :-2]) / H**2
        return lap - 6.0 * jnp.exp(u)

    def run(u0):
        return sx.newton_krylov(local_F, u0, rtol=1e-10, axis_name="i").u

    u = jax.jit(sx.shard_map(run, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(U0)
    reference = sx.newton_krylov(bratu(), U0, rtol=1e-10).u
    np.testing.assert_allclose(u, reference, atol=1e-9)
    with pytest.raises(ValueError, match="axis_name"):
        jax.jit(sx.shard_map(lambda u0: sx.newton_krylov(local_F, u0).u, mesh=mesh,
                             in_specs=P("i"), out_specs=P("i")))(U0)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(solver="cg"), ValueError, "`solver`"),
    (dict(forcing=1.5), ValueError, "`forcing`"),
    (dict(forcing=True), ValueError, "`forcing`"),
    (dict(forcing="ew"), ValueError, "`forcing`"),
    (dict(solver_options={"rtol": 1e-3}), ValueError, "`solver_options`"),
    (dict(solver_options=[("restart", 3)]), TypeError, "`solver_options`"),
    (dict(precond=lambda r: r, precond_builder=lambda u: sx.jacobi(u)), ValueError, "not both"),
    (dict(precond_builder=lambda u: (lambda r: r)), TypeError, "`precond_builder"),
    (dict(refresh=0), ValueError, "`refresh`"),
    (dict(max_inner=0), ValueError, "`max_inner`"),
    (dict(max_steps=-1), ValueError, "`max_steps`"),
    (dict(line_search="yes"), TypeError, "`line_search`"),
    (dict(rtol=-1.0), ValueError, "`rtol`"),
])
def test_bad_options_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        sx.newton_krylov(bratu(), U0, **kwargs)


def test_bad_problems_are_refused_and_the_nearest_valid_ones_solved():
    with pytest.raises(ValueError, match=r"F\(u0\)"):
        sx.newton_krylov(lambda u: u[:-1], jnp.ones(3))
    with pytest.raises(TypeError, match="u0"):
        sx.newton_krylov(lambda u: u, jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="`F`"):
        sx.newton_krylov("F", jnp.ones(3))
    # the nearest valid inputs: F shaped like u0, float u0, options at their limits
    F = lambda u: u**3 - 8.0  # noqa: E731
    for options in (dict(), dict(forcing=0.9), dict(max_inner=1), dict(max_backtracks=0),
                    dict(solver="gmres", solver_options={"restart": 2}), dict(refresh=1),
                    dict(precond_builder=lambda u: sx.jacobi(3 * u**2 + 1))):
        sol = sx.newton_krylov(F, jnp.full(3, 3.0), rtol=1e-12, **options)
        assert int(sol.status) == Status.CONVERGED, (options, sol.message)
        np.testing.assert_allclose(sol.u, 2.0, rtol=1e-10)
