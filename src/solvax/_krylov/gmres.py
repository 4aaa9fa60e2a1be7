"""Restarted flexible GMRES on pytrees: one Arnoldi step function per orthogonalization."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _checks, _driver, _method, _reduce
from . import _tree as tree
from ._dense import mm, qr, solve_triangular
from ._driver import Outcome, Problem
from ._method import nonzero
from ._solution import RUNNING, Solution, Status, code, first_status

PyTree = Any


ORTHOGONALIZATIONS = ("cgs2", "one_sync")


class _Estimate(NamedTuple):
    """A cycle's least-squares residual estimate, kept without Givens rotations
    (see `_finalize_column`); built by `_start_estimate`."""

    z: jax.Array  # (m + 1,) left null vector of the accepted columns
    zz: jax.Array  # ||z||^2
    beta: jax.Array  # ||r|| at the start of the cycle
    j: jax.Array  # accepted (final) Hessenberg columns
    flag: jax.Array  # RUNNING, or why the cycle ended


class _Column(NamedTuple):
    """A final Hessenberg column: `h[:col + 1]`, its subdiagonal and whether
    it (and whatever else its step reduced) is finite."""

    h: jax.Array
    hnext: jax.Array
    finite: jax.Array


class _Cgs2Cycle(NamedTuple):
    V: PyTree  # (m + 1, ...) orthonormal basis
    Z: PyTree | None  # (m, ...) preconditioned directions (None without a preconditioner)
    H: jax.Array  # (m + 1, m) Hessenberg matrix
    est: _Estimate
    k: jax.Array  # Arnoldi steps (matvecs) of this cycle
    anorm: jax.Array  # running estimate of ||A M|| (max ||A M v|| / ||v||)


class _OneSyncCycle(NamedTuple):
    V: PyTree  # (m + 2, ...) basis; row k is the pending direction u
    u: PyTree  # the pending row k of V, also kept apart (see `_one_sync_step`)
    Z: PyTree | None  # (m + 1, ...)
    H: jax.Array  # (m + 2, m + 2); column i stored at i + 1 (see `_arnoldi`)
    est: _Estimate
    k: jax.Array
    anorm: jax.Array
    # With a recycled block of `offset` rows and no preconditioner the
    # directions are `z_i = v_i + (C - U) E[:, i]` (`_one_sync_step`), kept as
    # the small `(offset, offset + m + 1)` matrix E instead of a basis Z.
    E: jax.Array | None = None


class _Outer(NamedTuple):
    x: PyTree
    k: jax.Array  # accepted Arnoldi steps in all
    restarts: jax.Array
    status: jax.Array
    broke: jax.Array  # the last cycle hit a breakdown
    stalls: jax.Array  # restarts in a row whose true residual did not decrease
    rnorm: jax.Array  # true residual norm at the last restart
    xnorm: jax.Array  # ||x|| there
    tol: jax.Array
    anorm: jax.Array
    history: jax.Array | None  # residual norm per accepted step (if recorded)
    space: Any = None  # the recycled pair (C, U), A U = C (`gcrot`); None: GMRES


def _start_estimate(beta, m: int, dtype, go=True, offset: int = 0) -> _Estimate:
    """The estimate before any column: `z = e_offset`, the first `offset`
    columns taken (a recycled block, see `_new_cycle`), running unless `go` is
    false."""
    return _Estimate(z=jnp.zeros((m + 1 + offset,), dtype).at[offset].set(1),
                     zz=jnp.ones((), jnp.finfo(dtype).dtype), beta=beta, j=jnp.int32(offset),
                     flag=first_status([(go, RUNNING)], Status.MAX_STEPS))


def _record(history, offset, est: _Estimate, first: int = 0):
    """Write the cycle's `beta` (the true residual) at `offset` and its
    estimates `beta / ||z[:i + 2]||` after it (one per accepted column `i`
    from column `first` on: the columns before it are a recycled block)."""
    if history is None:
        return None
    z = est.z[first:]
    m = z.shape[0] - 1
    estimates = est.beta / jnp.sqrt(jnp.cumsum(jnp.abs(z) ** 2))[1:]
    old = lax.dynamic_slice(history, (offset + 1,), (m,))
    new = jnp.where(_indices(m) < est.j - first, estimates.astype(history.dtype), old)
    return lax.dynamic_update_slice(history.at[offset].set(est.beta), new, (offset + 1,))


# The traced indices below are never negative (an index past either end is
# clamped, as XLA does). Where JAX accepts it (0.5 on), saying so drops its
# wrap-around select, which one-sync's column index got a kernel for.
_NO_WRAP = ({"allow_negative_indices": False}
            if "allow_negative_indices" in inspect.signature(lax.dynamic_slice).parameters
            else {})


def _indices(n: int) -> np.ndarray:
    """`0..n-1` as a NumPy int32 constant: compared with the int32 step counters
    without promotion (and folded, not computed, by XLA)."""
    return np.arange(n, dtype=np.int32)


def _get(x, i, axis=0):
    """`x[i]` along `axis` for a traced `i` (clamped into range)."""
    return lax.dynamic_index_in_dim(x, i, axis, keepdims=False, **_NO_WRAP)


def _put(x, i, value, axis=0):
    """`x` with index `i` along `axis` set to `value` (a dynamic update, not a scatter)."""
    value = jnp.asarray(value, x.dtype)
    return lax.dynamic_update_index_in_dim(x, jnp.expand_dims(value, axis), i, axis,
                                           **_NO_WRAP)


def _finalize_column(est: _Estimate, col, column: _Column, scale, tol):
    """Take the final Hessenberg column `col` into the residual estimate and
    decide whether the cycle goes on.

    No Givens rotations: the least-squares residual after columns `0..col` is
    `beta / ||z||` for the left null vector `z` of those columns (`z^H H = 0`,
    `z_0 = 1`), and each column adds one entry, `conj(z_{col+1}) = -(z^H h) /
    hnext`. `|z^H h| / ||z||` is the new column's diagonal after the earlier
    rotations would have been applied, so `rjj` below is the textbook's
    rotated diagonal. The solution comes from one QR at the end of the cycle
    (`_least_squares`). Per Arnoldi step this is one short dot product and a
    few scalars, where rotations kept four small arrays up to date (and XLA
    compiled a kernel for each). `scale` is the size below which a diagonal
    or subdiagonal counts as zero.

    Returns the estimate, whether the column was accepted, and whether the
    cycle extends its basis (accepted, and the space not invariant). Both are
    comparisons of the column's scalars; the flag (why a cycle ends) is a
    chain of its own that only the loop test reads, so XLA does not compile it
    into every update that depends on the step's outcome.
    """
    h, hnext, finite = column
    t = jnp.sum(jnp.conj(est.z) * h[: est.z.shape[0]])  # z^H h; z is zero beyond col
    rjj = jnp.sqrt(jnp.abs(t) ** 2 / est.zz + hnext * hnext)
    z_next = -jnp.conj(t) / tree.like(hnext, t)  # infinite for an exactly invariant space
    zz = est.zz + jnp.abs(z_next) ** 2
    estimate = est.beta / jnp.sqrt(zz)
    accept = finite & (scale < rjj)  # else the column adds nothing: A is singular here
    go = accept & (scale < hnext)  # else the space is invariant
    # z and ||z||^2 take a rejected column too: the cycle ends with it, and only
    # entries up to `j` are read afterwards (no mask on the accept chain).
    est = est._replace(z=_put(est.z, col + 1, z_next), zz=zz,
                       j=est.j + accept.astype(jnp.int32),
                       flag=first_status([(go & (tol < estimate), RUNNING),
                                          (~finite, Status.NONFINITE),
                                          (accept & (estimate <= tol), Status.CONVERGED)],
                                         Status.BREAKDOWN))
    return est, accept, go


def _least_squares(H, beta, j, row: int = 0):
    """`y` minimizing `||beta e_row - H[:, :j] y||` (zero beyond `j`), by one
    Householder QR of `[H | beta e_row]`: its last column becomes `Q^H beta e_row`.

    Unused columns are replaced by unit vectors below the used rows, so the
    factorization has full rank and their coefficients come out zero. (One
    elementwise expression builds the matrix, its masks NumPy constants: one
    kernel, where masks from `jnp.arange` were kernels of their own.)
    """
    m = H.shape[1]
    rows, cols = np.indices((m + 1, m + 1), dtype=np.int32)
    fill = (rows == cols + 1).astype(H.dtype)  # unit vectors below the used rows
    A = jnp.where(cols < j, jnp.pad(H, ((0, 0), (0, 1))),
                  jnp.where((rows == row) & (cols == m), jnp.asarray(beta, H.dtype), fill))
    R = qr(A, mode="r")
    y = solve_triangular(R[:m, :m], R[:m, m], lower=False)
    return jnp.where(_indices(m) < j, y, 0)


class _Context(NamedTuple):
    """What an Arnoldi step reads besides its cycle (all from the `Problem`)."""

    A: Callable
    precond: Callable | None
    ip: _reduce.Reduction
    tol: jax.Array
    tiny: float  # relative size of a negligible column entry (100 eps)
    offset: int = 0  # rows of a recycled block before the Arnoldi basis (`_new_cycle`)


def _apply(ctx: _Context, v):
    """`(M v, A M v)`, named for profiles."""
    with jax.named_scope("solvax.gmres.precond"):
        z = ctx.precond(v) if ctx.precond is not None else v
    with jax.named_scope("solvax.gmres.matvec"):
        return z, ctx.A(z)


def _cgs2_step(cy: _Cgs2Cycle, ctx: _Context) -> _Cgs2Cycle:
    """Extend the basis by one vector with CGS2: two reductions. The first pass
    is a plain projection; the second returns the squared norm with it, and the
    new norm follows by Pythagoras (the correction is already O(eps), so there
    is no cancellation)."""
    j = cy.est.j
    m = cy.H.shape[1]
    z, w = _apply(ctx, tree.basis_get(cy.V, j))
    active = _indices(m + 1) <= j
    with jax.named_scope("solvax.gmres.orthogonalize"):
        h1 = jnp.where(active, ctx.ip.project(cy.V, w), 0)
        w = tree.sub(w, tree.basis_combine(cy.V, h1))
        h2, ww = ctx.ip.project_with_norm(cy.V, w)
        h2 = jnp.where(active, h2, 0)
        w = tree.sub(w, tree.basis_combine(cy.V, h2))
    h = h1 + h2
    hnext = _reduce.real_sqrt(jnp.real(ww) - jnp.sum(jnp.abs(h2) ** 2))
    # Columns of H represent A M on unit vectors: ||A M|| >= ||A z_j|| = ||(h, hnext)||.
    anorm = jnp.maximum(cy.anorm, jnp.sqrt(jnp.sum(jnp.abs(h) ** 2) + hnext ** 2))
    finite = jnp.all(jnp.isfinite(h)) & jnp.isfinite(hnext)
    est, accept, keep = _finalize_column(cy.est, j, _Column(h, hnext, finite),
                                         ctx.tiny * anorm, ctx.tol)
    v_next = tree.scale(1.0 / jnp.where(keep, hnext, 1.0), w)
    return cy._replace(
        V=tree.basis_fill(cy.V, j + 1, [v_next], keep),
        Z=None if cy.Z is None else tree.basis_fill(cy.Z, j, [z], accept),
        # (a rejected column is written too: it lies beyond the accepted ones)
        H=_put(cy.H, j, _put(h, j + 1, hnext), axis=1),
        est=est, k=cy.k + 1, anorm=anorm,
    )


def _finish_pending(cy: _OneSyncCycle, ctx: _Context, a, finite):
    """One-sync's first half: `c = Q^H u`, `nu^2 = <u, u> - |c|^2` finish
    column `k - 1` (`+ c`, subdiagonal `nu`) from the projections `a = V^H u`.

    Returns `(c, nu, the finished column, its stored old value, anorm,
    estimate, go)`. At `k = 0` no column is finished (the first step only
    normalizes the residual): `c = 0` and the estimate stays as it was. With
    a recycled block of `offset` rows the first step is `k = offset`, its `c`
    the residual's (rounding-level) projections on the block, and the
    estimate's `beta` becomes that step's `nu`, the norm of the residual the
    cycle actually expands.
    """
    k = cy.k
    first = k == ctx.offset
    finished = _indices(cy.H.shape[0]) < k
    c = jnp.where(finished, a, 0)
    nu = _reduce.real_sqrt(jnp.real(_get(a, k)) - jnp.sum(jnp.abs(c) ** 2))
    # Column k - 1 is stored at column k (at k = 0 the unused column 0).
    column = _get(cy.H, k, axis=1)
    finished_col = _put(column + c, k, nu)
    if ctx.offset:  # at the first step, column offset - 1 is the block's last: final
        finished_col = jnp.where(first, column, finished_col)
    # Columns of H represent A M on unit vectors: ||A M|| >= ||H[:, k - 1]||.
    anorm = jnp.maximum(cy.anorm, jnp.where(
        first, 0, jnp.sqrt(jnp.sum(jnp.abs(finished_col) ** 2))))
    est, _, go = _finalize_column(cy.est, k - 1, _Column(finished_col, nu, finite),
                                  ctx.tiny * anorm, ctx.tol)
    if ctx.offset:
        est = est._replace(beta=jnp.where(first, nu.astype(est.beta.dtype), est.beta))
    est = est._replace(z=jnp.where(first, cy.est.z, est.z), zz=jnp.where(first, cy.est.zz, est.zz),
                       j=jnp.where(first, cy.est.j, est.j),
                       flag=jnp.where(first, first_status([(finite, RUNNING)], Status.NONFINITE),
                                      est.flag))
    return c, nu, finished_col, column, anorm, est, jnp.where(first, finite, go)


def _one_sync_step(cy: _OneSyncCycle, ctx: _Context) -> _OneSyncCycle:
    """One reduction per Arnoldi step: CGS2 with the second pass delayed by one
    step (in the spirit of DCGS2, Bielich et al. 2022).

    Row `k` of the basis holds `u`, the new direction after one CGS pass, not yet
    re-orthogonalized nor normalized. One projection of `u` and `w = A M u` on
    the basis gives `Q^H u`, `<u, u>`, `Q^H w` and `<u, w>`; `_finish_pending`
    turns the first two into `q_k = (u - Q c) / nu` and the final column
    `k - 1`. Since `A z_k = (w - Q H c) / nu` by the Arnoldi relation, the
    projections of the new column follow from the reduced values without
    touching `w` again: `h = (Q^H w - H c) / nu`, and the next pending vector
    is `u' = (w - Q (Q^H w)) / nu`. Column `k - 1` is final one step later, so
    the residual estimate lags one matvec behind CGS2's.
    """
    k = cy.k
    # u is kept apart from row k of V: the updates of rows k and k + 1 read it from
    # there, so XLA writes them in place (sliced from V, each step copied the basis).
    mu, w = _apply(ctx, cy.u)
    with jax.named_scope("solvax.gmres.orthogonalize"):
        projections, _ = ctx.ip.project_many(cy.V, [cy.u, w])
    a, bw = projections
    finite = jnp.all(jnp.isfinite(projections))
    c, nu, finished_col, column, anorm, est, go = _finish_pending(cy, ctx, a, finite)
    # Divisions by nu need no guard: if nu is 0 or not finite, go is false and
    # nothing computed from them is kept.

    # q_k, z_k and the first pass of the next direction. Both combinations read
    # the basis before row k changes, in one pass: Q (Q^H w) = V qw_old + qw[k] q,
    # where qw_old has no entry at row k (still u).
    qw_old = jnp.where(_indices(cy.H.shape[0]) < k, bw, 0)
    nu_h = tree.like(nu, bw)  # nu in H's dtype
    qk_w = (_get(bw, k) - jnp.sum(jnp.conj(c) * bw)) / nu_h  # <q_k, w>
    Vc, Vqw = tree.basis_combine_many(cy.V, [c, qw_old])
    q = tree.scale(1.0 / nu, tree.sub(cy.u, Vc))
    u_next = tree.scale(1.0 / nu, tree.sub(tree.sub(w, Vqw), tree.scale(qk_w, q)))
    Z, E = cy.Z, cy.E
    if E is not None:
        # z_k - q_k = sum_i c_i (w_i - z_i) / nu, with w_i - z_i = C_i - U_i
        # on the block and -(C - U) E[:, i] after it: one column of E.
        offset = E.shape[0]
        E = _put(E, k, jnp.where(go, (c[:offset] - mm(E, c[: E.shape[1]])) / nu_h, 0), axis=1)
    if Z is not None:
        Z = tree.basis_fill(Z, k, [tree.scale(1.0 / nu, tree.sub(
            mu, tree.basis_combine(Z, c[: cy.H.shape[0] - 1])))], go)
    # H[:, :k] c[:k], the finished column k - 1 included: the stored columns
    # 1..k (k still unfinished there) times c (shifted with them), plus the
    # finishing update times c[k - 1] (at k = 0, c = 0 wherever the index lands).
    Hc = mm(cy.H, jnp.pad(c[:-1], (1, 0))) + (finished_col - column) * _get(c, k - 1)
    h_next = (_put(qw_old, k, qk_w) - Hc) / nu_h
    # columns k - 1 and k (stored at k, k + 1) in one update; the new column is
    # read only once accepted, so it needs no mask
    H = lax.dynamic_update_slice(cy.H, jnp.stack([finished_col, h_next], axis=1),
                                 (jnp.zeros_like(k), k))
    return cy._replace(V=tree.basis_fill(cy.V, k, [q, u_next], go), u=u_next, Z=Z, H=H,
                       est=est, k=k + 1, anorm=anorm, E=E)



def _new_cycle(one_sync: bool, V, Z, r, beta, anorm, go, m: int, dtype, offset: int = 0):
    """A cycle from the residual `r`, `||r|| = beta`: the factory of both cycle types.

    One-sync: `r` is the pending row `offset`, which the first step
    normalizes (`c = 0`, `nu = ||r||`); CGS2 starts from `r / beta`.

    `offset > 0` (one-sync only): rows `0..offset-1` of `V` and `Z` hold a
    recycled pair `C`, `U` with `A U = C` (`_gcrot`). They are the first
    `offset` columns of the Arnoldi relation `A [U, Z] = [C, V] H`, already
    final: `H` starts as the identity there, so every step orthogonalizes
    against `C` in its one reduction and the least squares minimizes over
    `span(U)` as well (GCRO-DR's augmented space), with no code of its own.
    """
    est = _start_estimate(beta, m, dtype, go, offset)
    if one_sync:
        size = m + 2 + offset
        H = jnp.zeros((size, size), dtype)
        if offset:  # column i (stored at i + 1) = e_i
            H = H + jnp.asarray(np.eye(size, k=1) * (np.arange(size) < offset)[:, None], dtype)
        E = jnp.zeros((offset, size - 1), dtype) if offset and Z is None else None
        return _OneSyncCycle(V=tree.basis_set(V, offset, r), u=r, Z=Z, H=H, est=est,
                             k=jnp.int32(offset), anorm=anorm, E=E)
    v0 = tree.scale(1.0 / nonzero(beta), r)
    return _Cgs2Cycle(V=tree.basis_set(V, 0, v0), Z=Z, H=jnp.zeros((m + 1, m), dtype), est=est,
                      k=jnp.int32(0), anorm=anorm)


def _arnoldi(A, b, *, precond, ip, m, orthogonalization, offset: int = 0):
    """`run(r, beta, tol, anorm, go, space=None) -> (V, Z, H, estimate,
    anorm, E)`: one Arnoldi cycle from `r`, `||r|| = beta`, stopping early at
    `tol` (or not at all if `go` is false); `Z` (None without a
    preconditioner) are the directions that update `x`, and `V` the basis.
    With `offset > 0` (one-sync), `space = (C, U)` is a recycled block of
    `offset` rows ahead of the basis (`_new_cycle`); the returned `V`, `Z`
    and `H` include it, and without a preconditioner `E` gives the
    directions (`_OneSyncCycle.E`; else None)."""
    dtype = tree.result_dtype(b)
    real = jnp.finfo(dtype).dtype
    one_sync = orthogonalization == "one_sync"
    basis_V = tree.basis_alloc(b, m + 2 if one_sync else m + 1)
    basis_Z = tree.basis_alloc(b, m + 1 if one_sync else m) if precond is not None else None
    step = _one_sync_step if one_sync else _cgs2_step
    steps = offset + (m + 1 if one_sync else m)  # one_sync finishes column m - 1 at step m

    def run(r, beta, tol, anorm, go, space=None):
        ctx = _Context(A=A, precond=precond, ip=ip, tol=tol, tiny=100 * jnp.finfo(real).eps,
                       offset=offset)
        V, Z = basis_V, basis_Z
        if offset:
            C, U = space
            V = tree.basis_join([C, V])
            Z = None if Z is None else tree.basis_join([U, Z])
        cy = _new_cycle(one_sync, V, Z, r, beta, anorm, go, m, dtype, offset)
        cy = _method.while_loop(ip, b, lambda c: (c.est.flag == RUNNING) & (c.k < steps),
                                functools.partial(step, ctx=ctx), cy)
        # One-sync stores H one column to the right (a step then writes the column
        # it finishes and the new one in one update); the cycle returns it unshifted.
        p = m + offset
        H = cy.H[: p + 1, 1: p + 1] if one_sync else cy.H
        return cy.V, cy.Z, H, cy.est, cy.anorm, cy.E if one_sync else None

    return run


def _cycle(st: _Outer, problem: Problem, arnoldi, max_restarts: int, renew=None) -> _Outer:
    """One restart: the true residual, then (if it is not done) one Arnoldi
    cycle and the update of `x`.

    With a recycled space `st.space = (C, U)` (GCRO-DR, `gcrot`): the
    residual's projections `C^H r` ride in the residual's reduction, `x += U
    C^H r` and `r -= C C^H r` (exact for `A U = C`), the cycle runs with
    `(C, U)` ahead of its basis and `renew(V, Z, H, est, space, go, E, D)`
    gives the space for the next cycle (`_recycle.harmonic_space`; without
    a preconditioner the directions are `V + D E`, `D = C - U`)."""
    with jax.named_scope("solvax.gmres.residual"):
        # b tied to x: its norm rides in this reduction (a loop-invariant
        # product of its own would be hoisted out of the loop by XLA, into a
        # synchronization of its own)
        b, x = jax.lax.optimization_barrier((problem.b, st.x))
        Ax = problem.A(x)
        r = tree.sub(b, Ax)
        pairs = [(r, r), (b, b), (Ax, Ax), (x, x)]
        if st.space is None:
            rr, bb, axax, xx = jnp.real(problem.ip.multi_dot(pairs))
        else:
            cr, products = problem.ip.project_many(st.space[0], [r], pairs)
            rr, bb, axax, xx = jnp.real(products)
    beta = _reduce.real_sqrt(rr)
    tol = _driver.threshold(bb, *problem.tolerances())
    zero_b = bb == 0  # b = 0: the answer is exactly 0, whatever x0
    beta = jnp.where(zero_b, 0, beta)
    stalls = jnp.where((st.restarts > 0) & (beta >= st.rnorm), st.stalls + 1, 0)
    stagnated, rounding_limited = _stagnated(st, stalls, beta, bb, axax)
    # Another cycle runs if `tol < beta < inf` (comparisons only: false for NaN),
    # the last one neither broke down nor stagnated, and restarts are left.
    go = ((tol < beta) & (beta < jnp.inf) & ~st.broke & ~stagnated
          & (st.restarts < max_restarts))
    if st.space is None:
        offset, space, x = 0, None, st.x
        V, Z, H, est, anorm, _ = arnoldi(r, beta, tol, st.anorm, go)
        y = _least_squares(H, beta, est.j)
        directions = Z if problem.precond is not None else V
        update = tree.basis_combine(directions, _pad(y, directions))
    else:
        (C, U), cr = st.space, cr[0]
        offset = jax.tree_util.tree_leaves(C)[0].shape[0]
        # the part of r in span(C) solved for in span(U) (x unchanged if no cycle runs)
        x = tree.where(go, tree.add(st.x, tree.basis_combine(U, cr)), st.x)
        r = tree.sub(r, tree.basis_combine(C, cr))
        beta_perp = _reduce.real_sqrt(jnp.maximum(rr - jnp.sum(jnp.abs(cr) ** 2), 0))
        V, Z, H, est, anorm, E = arnoldi(r, beta_perp, tol, st.anorm, go, st.space)
        y = _least_squares(H, est.beta, est.j, row=offset)
        D = None
        if Z is not None:
            update = tree.basis_combine(Z, _pad(y, Z))
        else:  # directions [U, V + D E], D = C - U: V y + D (E y - y_C)
            D = tree.sub(C, U)
            update = tree.add(tree.basis_combine(V, _pad(y, V)),
                              tree.basis_combine(D, mm(E[:, : y.shape[0]], y) - y[:offset]))
        space = renew(V, Z, H, est, st.space, go, E, D)
    x = tree.where(zero_b, tree.zeros_like(b), tree.add(x, update))
    # After a cycle the next pass checks the true residual; with no cycle run,
    # this pass was that check and the loop ends, saying why no cycle ran.
    status = first_status([(go & (est.flag == code(Status.NONFINITE)), Status.NONFINITE),
                           (go, RUNNING),
                           (~(jnp.isfinite(rr) & jnp.isfinite(bb)), Status.NONFINITE),
                           (beta <= tol, Status.CONVERGED),
                           (st.broke & ~rounding_limited, Status.BREAKDOWN),
                           (stagnated | st.broke, Status.STAGNATION)], Status.MAX_STEPS)
    return _Outer(x=x, k=st.k + est.j - offset, restarts=st.restarts + go.astype(jnp.int32),
                  status=status, broke=est.flag == code(Status.BREAKDOWN), stalls=stalls,
                  rnorm=beta, xnorm=_reduce.real_sqrt(xx), tol=tol,
                  anorm=anorm, history=_record(st.history, st.k, est, offset), space=space)


def _stagnated(st: _Outer, stalls, beta, bb, axax):
    """`(stagnated, rounding_limited)` at a restart after a cycle.

    Stagnated: more restarts cannot help, because the true residual did not
    decrease over the last two cycles (GMRES never increases it, so the next
    cycle would repeat these: e.g. GMRES(1) on a skew-symmetric operator; the
    second cycle is where a singular operator shows as a breakdown) or it is
    at the rounding level of its own evaluation, `eps (||A x|| + ||b||)`.
    Rounding-limited: it is within `sqrt(eps)` of that scale, so a cycle that
    found no new direction met rounding, not a singular operator (`BREAKDOWN`
    is kept for residuals well above it, e.g. an inconsistent system).
    """
    eps = jnp.finfo(beta.dtype).eps
    scale = _reduce.real_sqrt(axax) + _reduce.real_sqrt(bb)
    ran = st.restarts > 0
    return ran & ((stalls >= 2) | (beta <= eps * scale)), beta <= jnp.sqrt(eps) * scale


def _options(size: int, restart: int, max_restarts: int | None) -> tuple[int, int]:
    """`(restart, max_restarts)` for `size` unknowns: at most `size` steps per
    cycle; by default `ceil(10 * size / restart)` cycles."""
    restart = min(restart, size)
    if max_restarts is None:
        max_restarts = -(-10 * size // restart)
    return restart, max_restarts


def restarted(problem: Problem, arnoldi, *, m: int, max_restarts: int, record_history: bool,
              space=None, renew=None) -> Outcome:
    """The restart loop of `gmres` and `gcrot` (with a recycled `space` and
    its `renew`, see `_cycle`); `Outcome.recycle` is the final space."""
    real = problem.real_dtype()
    x = tree.zeros_like(problem.b) if problem.x0 is None else problem.x0
    state = _Outer(x=x, k=jnp.int32(0), restarts=jnp.int32(0), status=code(RUNNING),
                   broke=jnp.bool_(False), stalls=jnp.int32(0),
                   rnorm=jnp.asarray(jnp.inf, real), xnorm=jnp.zeros((), real),
                   tol=jnp.zeros((), real), anorm=jnp.zeros((), real),
                   history=problem.history(max_restarts * m + m + 1, record_history),
                   space=space)
    # Each pass starts with the true residual; a pass with nothing left to do
    # (converged, broken down or out of restarts) ends the loop after that check,
    # so the driver needs no residual of its own.
    state = _method.while_loop(problem.ip, problem.b, lambda st: st.status == RUNNING,
                               functools.partial(_cycle, problem=problem, arnoldi=arnoldi,
                                                 max_restarts=max_restarts, renew=renew),
                               state)
    return Outcome(x=state.x, status=state.status, iterations=state.k, history=state.history,
                   residual=(state.rnorm, state.tol, state.xnorm), recycle=state.space)


def _run(problem: Problem, *, restart: int, max_restarts: int | None, orthogonalization: str,
         record_history: bool) -> Outcome:
    """The FGMRES iteration (not differentiated itself; see `gmres`)."""
    m, max_restarts = _options(problem.size(), restart, max_restarts)
    arnoldi = _arnoldi(problem.A, problem.b, precond=problem.precond, ip=problem.ip, m=m,
                       orthogonalization=orthogonalization)
    return restarted(problem, arnoldi, m=m, max_restarts=max_restarts,
                     record_history=record_history)


GMRES = _driver.register(_driver.Method("gmres", _run))


def arnoldi_basis(matvec, b, *, restart: int, orthogonalization: str = "cgs2", precond=None,
                  inner_product=None):
    """The orthonormal basis of one full Arnoldi cycle from `b` (diagnostics).

    Returns `(V, j)`: the basis pytree (leading axis: basis index) and the number
    of accepted steps; rows `0..j` of `V` are the basis vectors. Used to measure
    the loss of orthogonality `||I - V^H V||` of each orthogonalization.
    """
    ip = _reduce.resolve(inner_product)
    real = jnp.finfo(tree.result_dtype(b)).dtype
    V, _, _, est, _, _ = _arnoldi(matvec, b, precond=precond, ip=ip, m=restart,
                               orthogonalization=orthogonalization)(
        b, ip.norm(b), jnp.zeros((), real), jnp.zeros((), real), True)
    return V, est.j


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
    rtol: float | None = None,
    atol: float = 0.0,
    orthogonalization: str = "one_sync",
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
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
        rtol, atol: stop when `||b - A x|| <= max(atol, rtol * ||b||)`. The
            default `rtol` depends on the precision of `b`: `max(1e-8, 100 eps)`
            for its least precise leaf,
            1e-8 in float64 and 1.2e-5 in float32 (1e-8 is out of float32's
            reach: its rounding level is 6e-8).
        orthogonalization: `"one_sync"` (one reduction per step) or `"cgs2"` (two).
        record_history: store the residual norm after every accepted step in
            `Solution.history` (the true norm at each restart, the
            least-squares estimate within a cycle; NaN-padded to
            `max_restarts * restart + restart + 1`).
        inner_product: a `solvax.InnerProduct` (or `(x, y) -> scalar`).
        failed_derivative: `"nan"` (default): a derivative (`jax.grad`,
            `jax.jvp`) whose tangent or transposed solve did not converge is
            NaN, so a finite derivative is a correct one; `"keep"`: as computed.
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
    _checks.check_int("restart", restart, 1)
    if max_restarts is not None:
        # accepted steps (up to max_restarts * restart) are counted in int32
        _checks.check_int("max_restarts", max_restarts, 0, _checks.INT32_MAX // restart)
    _checks.check_choice("orthogonalization", orthogonalization, ORTHOGONALIZATIONS)
    return _driver.solve(GMRES, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, restart=int(restart),
                         max_restarts=max_restarts, orthogonalization=orthogonalization,
                         record_history=record_history)
