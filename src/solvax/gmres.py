"""Restarted flexible GMRES on pytrees."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.linalg import solve_triangular

from . import _checks, _reduce
from . import _tree as tree
from ._solution import RUNNING, Solution, Status, code, first_status, make_solution
from .linear_solve import krylov_solve

PyTree = Any


ORTHOGONALIZATIONS = ("cgs2", "one_sync")


class _Cycle(NamedTuple):
    """One Arnoldi cycle: basis, Hessenberg matrix and residual estimate."""

    V: PyTree  # (m + 1, ...) orthonormal basis; one_sync: (m + 2, ...), row k pending
    u: PyTree | None  # one_sync: the pending row k of V, also kept apart (see below)
    Z: PyTree  # (m, ...) preconditioned directions (None without a preconditioner)
    H: jax.Array  # the Hessenberg matrix (m + 1, m); in a one-sync loop (m + 2, m + 2),
    #               column i stored at i + 1 (see `_arnoldi`)
    z: jax.Array  # (m + 1,) left null vector of the accepted columns (see _finalize_column)
    zz: jax.Array  # ||z||^2
    beta: jax.Array  # ||r|| at the start of the cycle
    j: jax.Array  # accepted (final) Hessenberg columns
    k: jax.Array  # Arnoldi steps (matvecs) of this cycle
    anorm: jax.Array  # running estimate of ||A M|| (max ||A M v|| / ||v||)
    flag: jax.Array  # RUNNING, or why the cycle ended


class _Outer(NamedTuple):
    x: PyTree
    k: jax.Array  # accepted Arnoldi steps in all
    restarts: jax.Array
    status: jax.Array
    broke: jax.Array  # the last cycle hit a breakdown
    rnorm: jax.Array  # true residual norm at the last restart
    tol: jax.Array
    anorm: jax.Array
    history: jax.Array | None  # residual norm per accepted step (if recorded)


def _record(history, offset, cy: _Cycle):
    """Write the cycle's `beta` (the true residual) at `offset` and its
    estimates `beta / ||z[:i + 2]||` after it (one per accepted column `i`)."""
    if history is None:
        return None
    m = cy.z.shape[0] - 1
    estimates = cy.beta / jnp.sqrt(jnp.cumsum(jnp.abs(cy.z) ** 2))[1:]
    old = lax.dynamic_slice(history, (offset + 1,), (m,))
    new = jnp.where(np.arange(m) < cy.j, estimates.astype(history.dtype), old)
    return lax.dynamic_update_slice(history.at[offset].set(cy.beta), new, (offset + 1,))


# The traced indices below are never negative (an index past either end is
# clamped, as XLA does). Where JAX accepts it (0.5 on), saying so drops its
# wrap-around select, which one-sync's column index got a kernel for.
_NO_WRAP = ({"allow_negative_indices": False}
            if "allow_negative_indices" in inspect.signature(lax.dynamic_slice).parameters
            else {})


def _get(x, i, axis=0):
    """`x[i]` along `axis` for a traced `i` (clamped into range)."""
    return lax.dynamic_index_in_dim(x, i, axis, keepdims=False, **_NO_WRAP)


def _put(x, i, value, axis=0):
    """`x` with index `i` along `axis` set to `value` (a dynamic update, not a scatter)."""
    value = jnp.asarray(value, x.dtype)
    return lax.dynamic_update_index_in_dim(x, jnp.expand_dims(value, axis), i, axis,
                                           **_NO_WRAP)


def _finalize_column(cy: _Cycle, col, h, hnext, scale, tol, finite, enabled=True):
    """Take the final Hessenberg column `col` (`h[:col+1]`, subdiagonal `hnext`)
    into the residual estimate and decide whether the cycle goes on.

    No Givens rotations: the least-squares residual after columns `0..col` is
    `beta / ||z||` for the left null vector `z` of those columns (`z^H H = 0`,
    `z_0 = 1`), and each column adds one entry, `conj(z_{col+1}) = -(z^H h) /
    hnext`. `|z^H h| / ||z||` is the new column's diagonal after the earlier
    rotations would have been applied, so `rjj` below is the textbook's
    rotated diagonal. The solution comes from one QR at the end of the cycle
    (`_least_squares`). Per Arnoldi step this is one short dot product and a
    few scalars, where rotations kept four small arrays up to date (and XLA
    compiled a kernel for each).

    `finite`: the column (and whatever else the step reduced) is finite. With
    `enabled` false (a step with no column to finish) only `finite` counts.

    Returns the cycle, whether the column was accepted, and whether the cycle
    extends its basis (accepted, and the space not invariant). Both are
    comparisons of the column's scalars; the flag (why a cycle ends) is a
    chain of its own that only the loop test reads, so XLA does not compile it
    into every update that depends on the step's outcome.
    """
    enabled = jnp.asarray(enabled)
    t = jnp.sum(jnp.conj(cy.z) * h[: cy.z.shape[0]])  # z^H h; z is zero beyond col
    rjj = jnp.sqrt(jnp.abs(t) ** 2 / cy.zz + hnext * hnext)
    z_next = -jnp.conj(t) / hnext  # infinite for an exactly invariant space
    zz = cy.zz + jnp.abs(z_next) ** 2
    estimate = cy.beta / jnp.sqrt(zz)
    independent = finite & (scale < rjj)  # else the column adds nothing: A is singular here
    accept = enabled & independent
    go = jnp.where(enabled, independent & (scale < hnext), finite)  # else the space is invariant
    # z and ||z||^2 take a rejected column too: the cycle ends with it, and only
    # entries up to `j` are read afterwards (no mask on the accept chain).
    cy = cy._replace(
        z=jnp.where(enabled, _put(cy.z, col + 1, z_next), cy.z),
        zz=jnp.where(enabled, zz, cy.zz),
        j=cy.j + accept.astype(jnp.int32),
        flag=first_status([(go & (~enabled | (tol < estimate)), RUNNING),
                           (~finite, Status.NONFINITE),
                           (independent & (estimate <= tol), Status.CONVERGED)],
                          Status.BREAKDOWN),
    )
    return cy, accept, go


def _least_squares(H, beta, j):
    """`y` minimizing `||beta e_1 - H[:, :j] y||` (zero beyond `j`), by one
    Householder QR of `[H | beta e_1]`: its last column becomes `Q^H beta e_1`.

    Unused columns are replaced by unit vectors below the used rows, so the
    factorization has full rank and their coefficients come out zero. (One
    elementwise expression builds the matrix, its masks NumPy constants: one
    kernel, where masks from `jnp.arange` were kernels of their own.)
    """
    m = H.shape[1]
    rows, cols = np.indices((m + 1, m + 1))
    fill = (rows == cols + 1).astype(H.dtype)  # unit vectors below the used rows
    A = jnp.where(cols < j, jnp.pad(H, ((0, 0), (0, 1))),
                  jnp.where((rows == 0) & (cols == m), jnp.asarray(beta, H.dtype), fill))
    R = jnp.linalg.qr(A, mode="r")
    y = solve_triangular(R[:m, :m], R[:m, m], lower=False)
    return jnp.where(np.arange(m) < j, y, 0)


def _cgs2_step(cy: _Cycle, *, matvec, precond, ip, tol, tiny):
    """Extend the basis by one vector with CGS2: two reductions. The first pass
    is a plain projection; the second returns the squared norm with it, and the
    new norm follows by Pythagoras (the correction is already O(eps), so there
    is no cancellation)."""
    j = cy.j
    m = cy.H.shape[1]
    v = tree.basis_get(cy.V, j)
    with jax.named_scope("solvax.gmres.precond"):
        z = precond(v) if precond is not None else v
    with jax.named_scope("solvax.gmres.matvec"):
        w = matvec(z)
    active = np.arange(m + 1) <= j
    with jax.named_scope("solvax.gmres.orthogonalize"):
        h1 = jnp.where(active, ip.project(cy.V, w), 0)
        w = tree.sub(w, tree.basis_combine(cy.V, h1))
        h2, ww = ip.project_with_norm(cy.V, w)
        h2 = jnp.where(active, h2, 0)
        w = tree.sub(w, tree.basis_combine(cy.V, h2))
    h = h1 + h2
    hnext = _reduce.real_sqrt(jnp.real(ww) - jnp.sum(jnp.abs(h2) ** 2))
    # Columns of H represent A M on unit vectors: ||A M|| >= ||A z_j|| = ||(h, hnext)||.
    anorm = jnp.maximum(cy.anorm, jnp.sqrt(jnp.sum(jnp.abs(h) ** 2) + hnext ** 2))
    finite = jnp.all(jnp.isfinite(h)) & jnp.isfinite(hnext)
    cy, accept, keep = _finalize_column(cy._replace(anorm=anorm), j, h, hnext,
                                        tiny * anorm, tol, finite)
    v_next = tree.scale(1.0 / jnp.where(keep, hnext, 1.0), w)
    return cy._replace(
        V=tree.basis_fill(cy.V, j + 1, [v_next], keep),
        Z=None if cy.Z is None else tree.basis_fill(cy.Z, j, [z], accept),
        # (a rejected column is written too: it lies beyond the accepted ones)
        H=_put(cy.H, j, _put(h, j + 1, hnext), axis=1),
        k=cy.k + 1,
    )


def _one_sync_step(cy: _Cycle, *, matvec, precond, ip, tol, tiny):
    """One reduction per Arnoldi step: CGS2 with the second pass delayed by one
    step (in the spirit of DCGS2, Bielich et al. 2022).

    Row `k` of the basis holds `u`, the new direction after one CGS pass, not yet
    re-orthogonalized nor normalized. One projection of `u` and `w = A M u` on
    the basis gives `Q^H u`, `<u, u>`, `Q^H w` and `<u, w>`. Then `c = Q^H u`,
    `nu^2 = <u, u> - |c|^2` finish `q_k = (u - Q c) / nu` and Hessenberg column `k - 1` (`+ c`,
    subdiagonal `nu`); since `A z_k = (w - Q H c) / nu` by the Arnoldi
    relation, its projections follow from the reduced values without touching
    `w` again: `h = (Q^H w - H c) / nu`, and the next pending vector is
    `u' = (w - Q (Q^H w)) / nu`. Column `k - 1` is final one step later, so the
    residual estimate lags one matvec behind CGS2's.
    """
    k = cy.k
    rows = cy.H.shape[0]  # m + 2
    m = rows - 2
    # The pending vector is row k of V (so the one projection also gives <u, u>
    # and <u, w>) and is kept apart as well: the updates of rows k and k + 1 read
    # it from there, not from V, so XLA writes them in place (were u sliced from V
    # inside them, each step would copy the whole basis).
    u = cy.u
    with jax.named_scope("solvax.gmres.precond"):
        mu = precond(u) if precond is not None else u
    with jax.named_scope("solvax.gmres.matvec"):
        w = matvec(mu)
    with jax.named_scope("solvax.gmres.orthogonalize"):
        projections = ip.project_many(cy.V, [u, w])
    a, bw = projections
    finished = np.arange(rows) < k
    c = jnp.where(finished, a, 0)
    uu = jnp.real(_get(a, k))
    nu = _reduce.real_sqrt(uu - jnp.sum(jnp.abs(c) ** 2))
    finite = jnp.all(jnp.isfinite(projections))

    # Finish column k - 1 (stored at column k; at k = 0 that is the unused
    # column 0, c = 0 and `_finalize_column` is disabled, so what index k - 1 = -1
    # reads does not matter).
    column = _get(cy.H, k, axis=1)
    finished_col = _put(column + c, k, nu)
    # Columns of H represent A M on unit vectors: ||A M|| >= ||H[:, k - 1]||.
    anorm = jnp.maximum(cy.anorm, jnp.where(
        k > 0, jnp.sqrt(jnp.sum(jnp.abs(finished_col) ** 2)), 0))
    cy, _, go = _finalize_column(cy._replace(anorm=anorm), k - 1, finished_col,
                                 nu, tiny * anorm, tol, finite, enabled=k > 0)
    # Divisions by nu need no guard: if nu is 0 or not finite, go is false and
    # nothing computed from them is kept.

    # q_k, z_k and the first pass of the next direction. Both combinations read
    # the basis before row k changes, in one pass: Q (Q^H w) = V qw_old + qw[k] q,
    # where qw_old has no entry at row k (still u).
    qw_old = jnp.where(finished, bw, 0)
    qk_w = (_get(bw, k) - jnp.sum(jnp.conj(c) * bw)) / nu  # <q_k, w>
    qw = _put(qw_old, k, qk_w)
    Vc, Vqw = tree.basis_combine_many(cy.V, [c, qw_old])
    q = tree.scale(1.0 / nu, tree.sub(u, Vc))
    u_next = tree.scale(1.0 / nu, tree.sub(tree.sub(w, Vqw), tree.scale(qk_w, q)))
    Z = cy.Z
    if Z is not None:
        Z = tree.basis_fill(Z, k, [tree.scale(1.0 / nu, tree.sub(
            mu, tree.basis_combine(Z, c[: m + 1])))], go)
    # H[:, :k] c[:k], the finished column k - 1 included: the stored columns
    # 1..k (k still unfinished there) times c (shifted with them), plus the
    # finishing update times c[k - 1] (at k = 0, c = 0 wherever the index lands).
    Hc = cy.H @ jnp.pad(c[:-1], (1, 0)) + (finished_col - column) * _get(c, k - 1)
    h_next = (qw - Hc) / nu
    both = jnp.stack([finished_col, h_next], axis=1)
    return cy._replace(
        V=tree.basis_fill(cy.V, k, [q, u_next], go),
        u=u_next,
        Z=Z,
        # columns k - 1 and k (stored at k, k + 1) in one update; the new column
        # is read only once accepted, so it needs no mask
        H=lax.dynamic_update_slice(cy.H, both, (jnp.zeros_like(k), k)),
        k=k + 1,
    )


def _arnoldi(matvec, b, *, precond, ip, m, orthogonalization):
    """`run(r, beta, tol, anorm, go) -> _Cycle`: one Arnoldi cycle from `r`, `||r|| = beta`,
    stopping early at `tol` (or not at all if `go` is false)."""
    dtype = tree.result_dtype(b)
    real = jnp.finfo(dtype).dtype
    one_sync = orthogonalization == "one_sync"
    basis_V = tree.basis_alloc(b, m + 2 if one_sync else m + 1)
    basis_Z = tree.basis_alloc(b, m + 1 if one_sync else m) if precond is not None else None
    step = functools.partial(_one_sync_step if one_sync else _cgs2_step, matvec=matvec,
                             precond=precond, ip=ip, tiny=100 * jnp.finfo(real).eps)
    steps = m + 1 if one_sync else m  # one_sync finishes column m - 1 at step m

    def run(r, beta, tol, anorm, go) -> _Cycle:
        # One-sync: r is the pending row 0, which the first step normalizes (c = 0,
        # nu = ||r||); CGS2 starts from r / beta.
        v0 = r if one_sync else tree.scale(1.0 / jnp.where(beta == 0, 1.0, beta), r)
        cy = _Cycle(V=tree.basis_set(basis_V, 0, v0), u=v0 if one_sync else None, Z=basis_Z,
                    H=jnp.zeros((m + 2, m + 2) if one_sync else (m + 1, m), dtype),
                    z=jnp.zeros((m + 1,), dtype).at[0].set(1), zz=jnp.ones((), real),
                    beta=beta,
                    j=jnp.int32(0), k=jnp.int32(0), anorm=anorm,
                    flag=first_status([(go, RUNNING)], Status.MAX_STEPS))
        cy = lax.while_loop(lambda c: (c.flag == RUNNING) & (c.k < steps),
                            functools.partial(step, tol=tol), cy)
        # One-sync stores H one column to the right (a step then writes the column
        # it finishes and the new one in one update); the cycle returns it unshifted.
        return cy._replace(H=cy.H[: m + 1, 1: m + 1]) if one_sync else cy

    return run


def _gmres_solve(matvec, b, *, x0, precond, restart, max_restarts, rtol, atol, ip,
                 orthogonalization, record_history):
    """The FGMRES iteration (not differentiated itself; see `gmres`)."""
    dtype = tree.result_dtype(b)
    real = jnp.finfo(dtype).dtype
    m = restart
    rtol = jnp.asarray(rtol, real)
    atol = jnp.asarray(atol, real)
    arnoldi = _arnoldi(matvec, b, precond=precond, ip=ip, m=m,
                       orthogonalization=orthogonalization)

    def cycle(st: _Outer) -> _Outer:
        with jax.named_scope("solvax.gmres.residual"):
            r = tree.sub(b, matvec(st.x))
            rr, bb = jnp.real(ip.multi_dot([(r, r), (b, b)]))
        beta = _reduce.real_sqrt(rr)
        tol = jnp.maximum(atol, rtol * _reduce.real_sqrt(bb))
        zero_b = bb == 0  # b = 0: the answer is exactly 0, whatever x0
        beta = jnp.where(zero_b, 0, beta)
        # Another cycle runs if `tol < beta < inf` (comparisons only: false for NaN),
        # the last one did not break down and restarts are left.
        go = (tol < beta) & (beta < jnp.inf) & ~st.broke & (st.restarts < max_restarts)
        cy = arnoldi(r, beta, tol, st.anorm, go)

        y = _least_squares(cy.H, beta, cy.j)
        directions = cy.Z if precond is not None else cy.V
        update = tree.basis_combine(directions, _pad(y, directions))
        x = tree.where(zero_b, tree.zeros_like(b), tree.add(st.x, update))
        # After a cycle the next pass checks the true residual; with no cycle run,
        # this pass was that check and the loop ends, saying why no cycle ran.
        status = first_status([(go & (cy.flag == code(Status.NONFINITE)), Status.NONFINITE),
                               (go, RUNNING),
                               (~(jnp.isfinite(rr) & jnp.isfinite(bb)), Status.NONFINITE),
                               (beta <= tol, Status.CONVERGED),
                               (st.broke, Status.BREAKDOWN)], Status.MAX_STEPS)
        return _Outer(x=x, k=st.k + cy.j, restarts=st.restarts + go.astype(jnp.int32),
                      status=status,
                      broke=cy.flag == code(Status.BREAKDOWN),
                      rnorm=beta, tol=tol, anorm=cy.anorm,
                      history=_record(st.history, st.k, cy))

    x = tree.zeros_like(b) if x0 is None else x0
    state = _Outer(x=x, k=jnp.int32(0), restarts=jnp.int32(0), status=code(RUNNING),
                   broke=jnp.bool_(False), rnorm=jnp.asarray(jnp.inf, real),
                   tol=jnp.zeros((), real), anorm=jnp.zeros((), real),
                   history=jnp.full((max_restarts * m + m + 1,), jnp.nan, real)
                   if record_history else None)
    # Each pass starts with the true residual; a pass with nothing left to do
    # (converged, broken down or out of restarts) ends the loop after that check.
    state = lax.while_loop(lambda st: st.status == RUNNING, cycle, state)
    return make_solution(state.x, state.status, state.k, state.rnorm, state.tol,
                         history=state.history)


def arnoldi_basis(matvec, b, *, restart: int, orthogonalization: str = "cgs2", precond=None,
                  inner_product=None):
    """The orthonormal basis of one full Arnoldi cycle from `b` (diagnostics).

    Returns `(V, j)`: the basis pytree (leading axis: basis index) and the number
    of accepted steps; rows `0..j` of `V` are the basis vectors. Used to measure
    the loss of orthogonality `||I - V^H V||` of each orthogonalization.
    """
    ip = _reduce.resolve(inner_product)
    real = jnp.finfo(tree.result_dtype(b)).dtype
    beta = ip.norm(b)
    cy = _arnoldi(matvec, b, precond=precond, ip=ip, m=restart,
                  orthogonalization=orthogonalization)(b, beta, jnp.zeros((), real),
                                                        jnp.zeros((), real), True)
    return cy.V, cy.j


def _pad(y, basis):
    """Coefficients `y` padded with zeros to the basis length."""
    rows = jax.tree_util.tree_leaves(basis)[0].shape[0]
    return jnp.pad(y, (0, rows - y.shape[0]))


def gmres(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    restart: int = 30,
    max_restarts: int | None = None,
    rtol: float = 1e-8,
    atol: float = 0.0,
    orthogonalization: str = "one_sync",
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Solution:
    """Restarted flexible GMRES (FGMRES) with right preconditioning.

    Each cycle starts from the true residual `r = b - A x`, `v_0 = r / ||r||`,
    and builds `A z_j = sum_i h_ij v_i` with `z_j = M_j(v_j)` (the
    preconditioner may change from step to step), orthogonalized by classical
    Gram–Schmidt run twice (CGS2) — by default with the second pass delayed
    one step so that each step needs a single reduction (`"one_sync"`).
    The least-squares residual `min ||beta e_1 - H y||` is kept current
    through the left null vector of `H` (one short dot product per step, no
    Givens rotations); the cycle ends at the tolerance, a breakdown or after
    `restart` steps, and `x += Z y` with `y` from one Householder QR of `H`.

    Differs from the textbook / `jax.scipy.sparse.linalg.gmres`:
      1. One reduction per Arnoldi step (`"one_sync"`), or two with
         `orthogonalization="cgs2"`: each CGS pass is one stacked projection
         `[V^H w, <w, w>]`, and the new norm follows by Pythagoras on the
         second pass, where it is free of cancellation.
      2. `||b||` is computed with each restart's residual norm: no setup reduction.
      3. `converged` is decided on the true residual computed at the start of
         a cycle, never on the least-squares estimate.
      4. A new column that adds nothing to the range of `H` (singular `A`)
         is dropped and reported as `Status.BREAKDOWN`, as is an invariant
         Krylov space whose residual is above the tolerance; upstream
         implementations return huge `x` there.

    `orthogonalization="one_sync"` (the default) needs one reduction per
    Arnoldi step: the second CGS pass of each vector is delayed to the next
    step and shares its reduction (see `_one_sync_step`; Bielich et al. 2022,
    Świrydowicz et al. 2020). Each Hessenberg column becomes final one step
    later, so a cycle costs one more matvec than its accepted steps, while the
    accepted steps and the orthogonality (`||I - V^H V||` near machine
    precision on our test problems, like CGS2) stay the same; `docs/krylov.md`
    has the numbers.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b`.
        b: right-hand side, an array or any pytree of arrays (leaves keep
            their sharding; the basis is built leaf by leaf).
        x0: initial guess shaped like `b` (default zeros).
        precond: `v -> M v`, a right preconditioner (default identity); may be
            nonlinear or vary between calls (flexible GMRES).
        restart: Arnoldi steps per cycle (basis size).
        max_restarts: cycle limit (default `ceil(10 * size(b) / restart)`).
        rtol, atol: stop when `||b - A x|| <= max(atol, rtol * ||b||)`.
        orthogonalization: `"one_sync"` (one reduction per step) or `"cgs2"` (two).
        record_history: store the residual norm after every accepted step in
            `Solution.history` (the true norm at each restart, the
            least-squares estimate within a cycle; NaN-padded to
            `max_restarts * restart + restart + 1`).
        inner_product: a `solvax.InnerProduct` (or `(x, y) -> scalar`).
        axis_name: inside `shard_map`, the mesh axis the vectors are split over.

    Returns:
        A `Solution`; `iterations` counts accepted Arnoldi steps (columns of
        the Hessenberg matrix used for the solution).

    Raises:
        TypeError, ValueError: at trace time, for mismatched structures,
            shapes or dtypes, negative tolerances, `restart < 1`,
            `max_restarts < 0` or an unknown `orthogonalization`.

    Reference: Y. Saad, "A flexible inner-outer preconditioned GMRES
    algorithm", SIAM J. Sci. Comput. 14 (1993); L. Giraud et al., "Rounding
    error analysis of the classical Gram-Schmidt orthogonalization process",
    Numer. Math. 101 (2005); D. Bielich et al., "Low-synch Gram–Schmidt with
    delayed reorthogonalization for Krylov solvers", Parallel Comput. 112
    (2022); K. Świrydowicz et al., "Low synchronization Gram–Schmidt and
    generalized minimal residual algorithms", Numer. Linear Algebra Appl. 28
    (2020).
    """
    _checks.check_solver_inputs(matvec, b, x0, precond, rtol, atol)
    restart = _checks.check_int("restart", restart, 1)
    restart = min(restart, tree.size(b))
    if max_restarts is None:
        max_restarts = -(-10 * tree.size(b) // restart)
    max_restarts = _checks.check_int("max_restarts", max_restarts, 0)
    _checks.check_choice("orthogonalization", orthogonalization, ORTHOGONALIZATIONS)
    ip = _reduce.resolve(inner_product, axis_name)
    solve = functools.partial(_gmres_solve, restart=restart, max_restarts=max_restarts,
                              orthogonalization=orthogonalization,
                              record_history=bool(record_history))
    return krylov_solve(matvec, b, solve, x0=x0, precond=precond, rtol=rtol, atol=atol, ip=ip,
                        symmetric=False)
