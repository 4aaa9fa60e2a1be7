"""`gcrot` (GCRO-DR): the recycled space and its invariants, a sequence of
changing systems, the adjoint handed the forward space, one all-reduce per
Arnoldi step on a mesh (under `jit` and inside `shard_map`), pytrees,
`vmap`, bad input and the nearest valid input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, put
from jax.sharding import PartitionSpec as P

import solvax as sx

N = 24  # grid side


def operator(c=0.4, shift=0.05):
    """Nonsymmetric convection-diffusion on an N x N grid (Dirichlet)."""
    def A(u):
        up = jnp.pad(u, 1)
        lap = 4 * u - up[2:, 1:-1] - up[:-2, 1:-1] - up[1:-1, 2:] - up[1:-1, :-2]
        return shift * u + lap + c * (up[2:, 1:-1] - up[:-2, 1:-1])
    return A


def rhs(seed=0, shape=(N, N)):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def rows(A, basis):
    return jnp.stack([A(basis[i]) for i in range(basis.shape[0])])


def test_the_space_is_orthonormal_and_a_u_is_c():
    A = operator()
    sol = sx.gcrot(A, rhs(), m=15, k=5, rtol=1e-10)
    assert bool(sol.converged), sol.message
    C, U = sol.recycle
    assert C.shape == U.shape == (5, N, N)
    flat = C.reshape(5, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(5), atol=1e-12)
    np.testing.assert_allclose(rows(A, U), C, atol=1e-10)
    # the answer is the system's
    np.testing.assert_allclose(A(sol.x), rhs(), atol=1e-8 * float(jnp.linalg.norm(rhs())))


def test_deflation_beats_restarted_gmres_of_the_same_cycle_length():
    A, b = operator(), rhs()
    gm = sx.gmres(A, b, restart=15, rtol=1e-10)
    gc = sx.gcrot(A, b, m=15, k=5, rtol=1e-10)
    assert bool(gm.converged) and bool(gc.converged)
    assert int(gc.iterations) < 0.9 * int(gm.iterations), (gc.iterations, gm.iterations)


def test_a_sequence_recycles_its_space_and_every_answer_is_right():
    """Slowly changing operators and right-hand sides: the second and later
    solves, handed the previous space (refreshed for their operator), take
    fewer Arnoldi steps than from an empty space."""
    recycle, warm, cold = None, [], []
    for step in range(4):
        A, b = operator(c=0.4 + 0.02 * step), rhs(seed=step)
        sol = sx.gcrot(A, b, m=15, k=8, rtol=1e-10, recycle=recycle)
        fresh = sx.gcrot(A, b, m=15, k=8, rtol=1e-10)
        assert bool(sol.converged) and bool(fresh.converged)
        np.testing.assert_allclose(sol.x, fresh.x, atol=1e-7 * float(jnp.max(jnp.abs(sol.x))))
        recycle = sol.recycle
        warm.append(int(sol.iterations))
        cold.append(int(fresh.iterations))
    assert warm[0] == cold[0]
    assert sum(warm[1:]) < sum(cold[1:]), (warm, cold)


def test_gradient_matches_gmres_and_the_adjoint_reuses_the_space():
    """`grad` through a recycled solve equals `grad` through GMRES; the
    transposed solve of this mildly nonsymmetric operator, handed the
    forward space, takes fewer matvecs (its refresh's `k` included) than a
    cold one (measured on this grid: 79 + 8 against 90 at c = 0.05; at c =
    0.4 the forward space costs more than it saves, 118 against 86, which
    `adjoint_recycle=False` avoids)."""
    b = rhs()
    w = rhs(seed=5)

    def loss(solver):
        def f(c):
            return jnp.sum(w * solver(operator(c), b).x)
        return f

    for reuse in (True, False):
        g_gcrot = jax.grad(loss(lambda A, b, reuse=reuse: sx.gcrot(
            A, b, m=15, k=8, rtol=1e-11, adjoint_recycle=reuse)))(0.05)
        g_gmres = jax.grad(loss(lambda A, b: sx.gmres(A, b, restart=15, rtol=1e-11)))(0.05)
        np.testing.assert_allclose(g_gcrot, g_gmres, rtol=1e-6)
    # the transposed system, solved cold and with the forward space
    A = operator(0.05)
    At = jax.linear_transpose(A, b)
    forward = sx.gcrot(A, b, m=15, k=8, rtol=1e-11)
    cold = sx.gcrot(lambda v: At(v)[0], w, m=15, k=8, rtol=1e-11)
    warm = sx.gcrot(lambda v: At(v)[0], w, m=15, k=8, rtol=1e-11, recycle=forward.recycle)
    assert bool(cold.converged) and bool(warm.converged)
    assert int(warm.iterations) + 8 < int(cold.iterations), (warm.iterations, cold.iterations)
    # (the collectives of the transposed solve, 2 more than the primal for the
    # refresh, are pinned with the registry: tests/test_sharding.py)


def test_a_failed_transposed_solve_makes_the_gradient_nan():
    b = rhs()

    def f(c):
        return jnp.sum(sx.gcrot(operator(c), b, m=6, k=2, max_restarts=1).x)

    assert np.isnan(float(jax.grad(f)(0.4)))


def test_pytrees_vmap_and_jit():
    A = operator()

    def tree_op(t):
        return {"a": A(t["a"]), "b": 3.0 * t["b"]}

    b = {"a": rhs(), "b": jnp.ones(5)}
    sol = jax.jit(lambda b: sx.gcrot(tree_op, b, m=15, k=4, rtol=1e-10))(b)
    assert bool(sol.converged)
    assert sol.recycle.C["a"].shape == (4, N, N) and sol.recycle.U["b"].shape == (4, 5)
    again = sx.gcrot(tree_op, b, m=15, k=4, rtol=1e-10, recycle=sol.recycle)
    assert bool(again.converged) and int(again.iterations) < int(sol.iterations)
    batch = jnp.stack([rhs(1), rhs(2)])
    out = jax.vmap(lambda b: sx.gcrot(A, b, m=15, k=4, rtol=1e-10))(batch)
    assert bool(jnp.all(out.converged)) and out.recycle.C.shape == (2, 4, N, N)


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_one_all_reduce_per_arnoldi_step_on_a_mesh(mode):
    """Per Arnoldi step one all-reduce (the projections on `[C, V]`), per
    restart the residual's (with `C^H r`) and the harmonic update's Gram
    matrix; a given space's refresh two more per solve; no gather."""
    m = mesh(8)
    b = put(rhs(shape=(64, 8)), m, "i", None)
    spec = P("i", None)
    given = sx.gcrot(operator(), rhs(shape=(64, 8)), m=10, k=4, rtol=1e-10).recycle
    # the bases sharded like b; the ledger (two costs) replicated
    given = sx.RecycleSpace(*(put(v, m, None, "i", None) for v in given), given.ledger)

    def solve(b, space, axis_name=None):
        if axis_name is None:
            return sx.gcrot(operator(), b, m=10, k=4, recycle=space).x
        A = sx.stencil_operator(
            {(0, 0): 4.05, (1, 0): -1.0 + 0.4, (-1, 0): -1.0 - 0.4, (0, 1): -1.0,
             (0, -1): -1.0}, shape=(8, 8), axis_names=("i", None))
        return sx.gcrot(A, b, m=10, k=4, recycle=space, axis_name=axis_name).x

    if mode == "jit":
        f = solve
    else:
        f = sx.shard_map(lambda b, s: solve(b, s, "i"), mesh=m,
                         in_specs=(spec, sx.RecycleSpace(P(None, "i", None),
                                                         P(None, "i", None))),
                         out_specs=spec)
    report = sx.count_collectives(f, b, given)
    assert report.step_count("all-reduce") == 1, str(report)
    assert report.count("all-gather") == 0
    restart = [loop.name for loop in report.loops
               if loop.depth == 0 and report.loop_count(loop.name, "all-reduce")]
    assert [report.loop_count(name, "all-reduce") for name in restart] == [2], str(report)
    # the scale, the refresh's two Cholesky QRs, the restart loop's two, the step's one
    assert report.count("all-reduce") == 6, str(report)


def test_bad_input_is_refused_and_the_nearest_valid_input_solved():
    A, b = operator(), rhs()
    with pytest.raises(ValueError, match="`k`"):
        sx.gcrot(A, b, m=10, k=10)
    assert bool(sx.gcrot(A, b, m=10, k=9, rtol=1e-8).converged)
    with pytest.raises(ValueError, match="`k`"):
        sx.gcrot(A, b, k=0)
    space = sx.gcrot(A, b, m=10, k=4, rtol=1e-8).recycle
    with pytest.raises(ValueError, match="another grid"):
        sx.gcrot(A, b[:-1, :-1], m=10, k=4, recycle=space)
    with pytest.raises(ValueError, match="another grid or another `k`"):
        sx.gcrot(A, b, m=10, k=5, recycle=space)
    with pytest.raises(ValueError, match="structure of `b`"):
        sx.gcrot(A, b, m=10, k=4, recycle=({"a": space.C}, space.U))
    with pytest.raises(TypeError, match="pair"):
        sx.gcrot(A, b, m=10, k=4, recycle=space.C)
    with pytest.raises(TypeError, match="precision"):
        sx.gcrot(A, b, m=10, k=4, recycle=jax.tree_util.tree_map(
            lambda v: v.astype(jnp.float32), space))
    assert bool(sx.gcrot(A, b, m=10, k=4, recycle=tuple(space), rtol=1e-8).converged)


def test_newton_krylov_recycles_across_newton_steps():
    """solver="gcrot": each Newton step's linear solve is handed the space of
    the step before; the root is found and the inner iterations over all
    steps are fewer than BiCGStab's (Bratu, no preconditioner)."""
    n, lam = 32, 6.0
    h = 1.0 / (n + 1)

    def F(u):
        up = jnp.pad(u, 1)
        lap = (4 * u - up[2:, 1:-1] - up[:-2, 1:-1] - up[1:-1, 2:] - up[1:-1, :-2]) / h**2
        return lap - lam * jnp.exp(u)

    u0 = jnp.zeros((n, n))
    gc = sx.newton_krylov(F, u0, solver="gcrot", solver_options={"m": 20, "k": 6}, rtol=1e-9)
    bi = sx.newton_krylov(F, u0, rtol=1e-9)
    assert bool(gc.converged) and bool(bi.converged)
    np.testing.assert_allclose(gc.u, bi.u, atol=1e-6)
    assert int(gc.linear_iterations) < int(bi.linear_iterations)
    with pytest.raises(ValueError, match="recycle"):
        sx.newton_krylov(F, u0, solver="gcrot", solver_options={"recycle": None})


def test_the_ledger_drops_a_space_that_costs_more_than_it_saves():
    """A space's ledger (`[cold, recycled]` matvecs per decade, and the
    recycled solves since the cold cost) decides its refresh: where
    recycling cost more, or won narrowly against an old cold cost (a probe),
    the solve runs cold (the iterations and answer of `recycle=None`, no
    refresh) and records its cost in the cold entry (age 0); where it cost
    less, or without a ledger, the space is refreshed and used, the recycled
    entry updated and the age counted."""
    A = operator()
    first = sx.gcrot(A, rhs(0), m=10, k=4, rtol=1e-10)
    cold, recycled, age = np.asarray(first.recycle.ledger)
    assert cold > 0 and np.isfinite(cold) and np.isnan(recycled) and age == 0
    C, U = first.recycle
    solve = jax.jit(lambda space: sx.gcrot(A, rhs(1), m=10, k=4, rtol=1e-10, recycle=space))
    fresh = sx.gcrot(A, rhs(1), m=10, k=4, rtol=1e-10)
    unknown = solve(sx.RecycleSpace(C, U))  # a space given by hand: always used
    assert int(unknown.iterations) < int(fresh.iterations)
    for ledger, used in (([1.0, 2.0, 0.0], False), ([1.0, 0.9, 4.0], False),
                         ([1.0, 0.9, 3.0], True), ([1.0, 0.5, 4.0], True)):
        out = solve(sx.RecycleSpace(C, U, jnp.array(ledger)))
        assert bool(out.converged)
        cold, recycled, age = np.asarray(out.recycle.ledger)
        if used:
            assert int(out.iterations) == int(unknown.iterations)
            assert cold == ledger[0] and recycled != ledger[1] and age == ledger[2] + 1
        else:
            assert int(out.iterations) == int(fresh.iterations)
            np.testing.assert_allclose(out.x, fresh.x, rtol=1e-10, atol=1e-12)
            assert cold != ledger[0] and recycled == ledger[1] and age == 0


def test_a_ledger_of_another_shape_is_refused_and_a_space_without_one_accepted():
    A = operator()
    C, U = sx.gcrot(A, rhs(0), m=10, k=4).recycle
    with pytest.raises(ValueError, match="ledger"):
        sx.gcrot(A, rhs(1), m=10, k=4, recycle=sx.RecycleSpace(C, U, jnp.zeros(2)))
    assert bool(sx.gcrot(A, rhs(1), m=10, k=4, recycle=sx.RecycleSpace(C, U)).converged)
    assert bool(sx.gcrot(A, rhs(1), m=10, k=4, recycle=(C, U)).converged)


def test_a_ledgered_sequence_differentiates_inside_shard_map():
    """Spaces handed on with their ledgers inside `shard_map`, a derivative
    through the whole sequence (the transposed solves run without a ledger)."""
    m = mesh(8)
    d = put(jnp.asarray(2.0 + np.random.default_rng(0).random(512)), m, "i")
    b = put(jnp.ones(512), m, "i")

    def sequence(d, b):
        space, x = None, b
        for scale in (1.0, 1.1, 1.2):
            s = sx.gcrot(lambda v, c=scale: c * d * v, b, m=12, k=4, axis_name="i",
                         rtol=1e-10, recycle=space)
            space, x = s.recycle, s.x
        return x

    f = jax.jit(sx.shard_map(sequence, mesh=m, in_specs=(P("i"), P("i")), out_specs=P("i")))
    np.testing.assert_allclose(f(d, b), np.asarray(b) / (1.2 * np.asarray(d)), rtol=1e-8)
    grad = jax.grad(lambda d: jnp.sum(f(d, b) ** 2))(d)
    want = -2 * np.asarray(b) ** 2 / (1.2 ** 2 * np.asarray(d) ** 3)
    np.testing.assert_allclose(grad, want, rtol=1e-6)
