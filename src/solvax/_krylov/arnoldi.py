"""The Arnoldi process on pytrees for flexible GMRES and GCRO-DR: one step
function per orthogonalization (CGS2, one-synchronization), the
Hessenberg least-squares estimate, and a cycle of steps."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import reduce, tree
from .._core.dense import mm, qr, solve_triangular
from .._core.solution import RUNNING, Status, first_status
from . import steps
from .steps import nonzero

PyTree = Any


class Estimate(NamedTuple):
    """A cycle's least-squares residual estimate, kept without Givens rotations
    (see `finalize_column`); built by `start_estimate`."""

    z: jax.Array  # (m + 1,) left null vector of the accepted columns
    zz: jax.Array  # ||z||^2
    beta: jax.Array  # ||r|| at the start of the cycle
    j: jax.Array  # accepted (final) Hessenberg columns
    flag: jax.Array  # RUNNING, or why the cycle ended


class Column(NamedTuple):
    """A final Hessenberg column: `h[:col + 1]`, its subdiagonal and whether
    it (and whatever else its step reduced) is finite."""

    h: jax.Array
    hnext: jax.Array
    finite: jax.Array


class _Cgs2Cycle(NamedTuple):
    V: PyTree  # (m + 1, ...) orthonormal basis
    Z: PyTree | None  # (m, ...) preconditioned directions (None without a preconditioner)
    H: jax.Array  # (m + 1, m) Hessenberg matrix
    est: Estimate
    k: jax.Array  # Arnoldi steps (matvecs) of this cycle
    anorm: jax.Array  # running estimate of ||A M|| (max ||A M v|| / ||v||)


class _OneSyncCycle(NamedTuple):
    V: PyTree  # (m + 2, ...) basis; row k is the pending direction u
    u: PyTree  # the pending row k of V, also kept apart (see `_one_sync_step`)
    Z: PyTree | None  # (m + 1, ...)
    H: jax.Array  # (m + 2, m + 2); column i stored at i + 1 (see `make_arnoldi`)
    est: Estimate
    k: jax.Array
    anorm: jax.Array
    # With a recycled block of `offset` rows and no preconditioner the
    # directions are `z_i = v_i + (C - U) E[:, i]` (`_one_sync_step`), kept as
    # the small `(offset, offset + m + 1)` matrix E instead of a basis Z.
    E: jax.Array | None = None


def start_estimate(beta, m: int, dtype, go=True, offset: int = 0) -> Estimate:
    """The estimate before any column: `z = e_offset`, the first `offset`
    columns taken (a recycled block, see `_new_cycle`), running unless `go` is
    false."""
    return Estimate(z=jnp.zeros((m + 1 + offset,), dtype).at[offset].set(1),
                     zz=jnp.ones((), jnp.finfo(dtype).dtype), beta=beta, j=jnp.int32(offset),
                     flag=first_status([(go, RUNNING)], Status.MAX_STEPS))


def record(history, offset, est: Estimate, first: int = 0):
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


#: Static sizes a step's basis reads are rounded up to (`on_rows`).
ROW_PARTS = 4


@jax.custom_batching.custom_vmap
def _uniform(index):
    """`index`, the same for every member of a batch: under `vmap` its
    largest value (so a `lax.switch` on it stays one conditional, where a
    batched index would compute every branch)."""
    return index


@_uniform.def_vmap
def _uniform_vmap(axis_size, in_batched, index):
    return (jnp.max(index) if in_batched[0] else index), False


def _rows(basis, size: int | None):
    """The first `size` rows of a basis (a static slice; None: all of them)."""
    return jax.tree_util.tree_map(lambda leaf: leaf[:size], basis)


def on_rows(fn, used, total: int):
    """`fn(size)`: a step's work on the first `size` rows of a basis of
    `total` rows, for the least of `ROW_PARTS` static sizes that covers
    the `used` rows in use (traced; under `vmap` the batch's most), one
    `lax.switch` branch per size, where `reduce.reads_rows_in_use` (one
    TPU); else `fn(None)`: every row, in the form a mesh and a CPU run.
    `fn` must give the same shapes for every size and take rows past
    `used` as contributing nothing: reading more rows than needed is the
    mesh's form (and a batch's), not a different answer."""
    sizes = sorted({-(-total * i // ROW_PARTS) for i in range(1, ROW_PARTS + 1)})
    if len(sizes) == 1 or not reduce.reads_rows_in_use():
        return fn(None)
    index = sum((used > size).astype(jnp.int32) for size in sizes[:-1])
    return lax.switch(_uniform(index), [functools.partial(fn, size) for size in sizes])


def _padded_rows(p, total: int):
    """Projections `p` on a basis' first rows (the last axis), zero-padded to `total` rows."""
    if p.shape[-1] == total:
        return p
    return jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, total - p.shape[-1])])


def _combined(basis, coeffs: list, used) -> list:
    """`[basis^T c for c in coeffs]`, each `c` (as long as the basis) zero
    from row `used` on: on the rows in use where `on_rows` says so, one sum
    per coefficient vector there (XLA:TPU copied a sliced block into memory
    before a sum of two at once: `reduce.reads_rows_in_use`), else one pass
    over every row for all of them (`tree.basis_combine_many`)."""
    def combine(size):
        if size is None:
            return tree.basis_combine_many(basis, coeffs)
        return [tree.basis_combine(_rows(basis, size), c[:size]) for c in coeffs]

    return on_rows(combine, used, coeffs[0].shape[0])


def finalize_column(est: Estimate, col, column: Column, scale, tol):
    """Take the final Hessenberg column `col` into the residual estimate and
    decide whether the cycle goes on.

    No Givens rotations: the least-squares residual after columns `0..col` is
    `beta / ||z||` for the left null vector `z` of those columns (`z^H H = 0`,
    `z_0 = 1`), and each column adds one entry, `conj(z_{col+1}) = -(z^H h) /
    hnext`. `|z^H h| / ||z||` is the new column's diagonal after the earlier
    rotations would have been applied, so `rjj` below is the textbook's
    rotated diagonal. The solution comes from one QR at the end of the cycle
    (`least_squares`). Per Arnoldi step this is one short dot product and a
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


def least_squares(H, beta, j, row: int = 0):
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
    ip: reduce.Reduction
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
    is no cancellation). Both passes read rows `0..j` of the basis only, where
    `on_rows` says so."""
    j = cy.est.j
    m = cy.H.shape[1]
    z, w = _apply(ctx, tree.basis_get(cy.V, j))
    active = _indices(m + 1) <= j

    def orthogonalize(size, w):
        V = _rows(cy.V, size)
        h1 = jnp.where(active, _padded_rows(ctx.ip.project(V, w), m + 1), 0)
        w = tree.sub(w, tree.basis_combine(V, h1[:size]))
        h2, ww = ctx.ip.project_with_norm(V, w)
        h2 = jnp.where(active, _padded_rows(h2, m + 1), 0)
        return h1, h2, ww, tree.sub(w, tree.basis_combine(V, h2[:size]))

    with jax.named_scope("solvax.gmres.orthogonalize"):
        h1, h2, ww, w = on_rows(lambda size: orthogonalize(size, w), j + 1, m + 1)
    h = h1 + h2
    hnext = reduce.real_sqrt(jnp.real(ww) - jnp.sum(jnp.abs(h2) ** 2))
    # Columns of H represent A M on unit vectors: ||A M|| >= ||A z_j|| = ||(h, hnext)||.
    anorm = jnp.maximum(cy.anorm, jnp.sqrt(jnp.sum(jnp.abs(h) ** 2) + hnext ** 2))
    finite = jnp.all(jnp.isfinite(h)) & jnp.isfinite(hnext)
    est, accept, keep = finalize_column(cy.est, j, Column(h, hnext, finite),
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
    nu = reduce.real_sqrt(jnp.real(_get(a, k)) - jnp.sum(jnp.abs(c) ** 2))
    # Column k - 1 is stored at column k (at k = 0 the unused column 0).
    column = _get(cy.H, k, axis=1)
    finished_col = _put(column + c, k, nu)
    if ctx.offset:  # at the first step, column offset - 1 is the block's last: final
        finished_col = jnp.where(first, column, finished_col)
    # Columns of H represent A M on unit vectors: ||A M|| >= ||H[:, k - 1]||.
    anorm = jnp.maximum(cy.anorm, jnp.where(
        first, 0, jnp.sqrt(jnp.sum(jnp.abs(finished_col) ** 2))))
    est, _, go = finalize_column(cy.est, k - 1, Column(finished_col, nu, finite),
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
    the residual estimate lags one matvec behind CGS2's. The products read
    rows `0..k` of the basis only, where `on_rows` says so.
    """
    k = cy.k
    # u is kept apart from row k of V: the updates of rows k and k + 1 read it from
    # there, so XLA writes them in place (sliced from V, each step copied the basis).
    mu, w = _apply(ctx, cy.u)
    rows = cy.H.shape[0]  # of V; rows 0..k in use (row k is u)
    with jax.named_scope("solvax.gmres.orthogonalize"):
        projections = on_rows(lambda size: _padded_rows(
            ctx.ip.project_many(_rows(cy.V, size), [cy.u, w])[0], rows), k + 1, rows)
    a, bw = projections
    finite = jnp.all(jnp.isfinite(projections))
    c, nu, finished_col, column, anorm, est, go = _finish_pending(cy, ctx, a, finite)
    # Divisions by nu need no guard: if nu is 0 or not finite, go is false and
    # nothing computed from them is kept.

    # q_k, z_k and the first pass of the next direction. Both combinations read
    # the basis before row k changes, in one pass: Q (Q^H w) = V qw_old + qw[k] q,
    # where qw_old has no entry at row k (still u).
    qw_old = jnp.where(_indices(rows) < k, bw, 0)
    nu_h = tree.like(nu, bw)  # nu in H's dtype
    qk_w = (_get(bw, k) - jnp.sum(jnp.conj(c) * bw)) / nu_h  # <q_k, w>
    Vc, Vqw = _combined(cy.V, [c, qw_old], k)  # both zero from row k on
    q = tree.scale(1.0 / nu, tree.sub(cy.u, Vc))
    u_next = tree.scale(1.0 / nu, tree.sub(tree.sub(w, Vqw), tree.scale(qk_w, q)))
    Z, E = cy.Z, cy.E
    if E is not None:
        # z_k - q_k = sum_i c_i (w_i - z_i) / nu, with w_i - z_i = C_i - U_i
        # on the block and -(C - U) E[:, i] after it: one column of E.
        offset = E.shape[0]
        E = _put(E, k, jnp.where(go, (c[:offset] - mm(E, c[: E.shape[1]])) / nu_h, 0), axis=1)
    if Z is not None:
        Zc, = _combined(Z, [c[: rows - 1]], k)
        Z = tree.basis_fill(Z, k, [tree.scale(1.0 / nu, tree.sub(mu, Zc))], go)
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
    recycled pair `C`, `U` with `A U = C` (`gcrot.py`). They are the first
    `offset` columns of the Arnoldi relation `A [U, Z] = [C, V] H`, already
    final: `H` starts as the identity there, so every step orthogonalizes
    against `C` in its one reduction and the least squares minimizes over
    `span(U)` as well (GCRO-DR's augmented space), with no code of its own.
    """
    est = start_estimate(beta, m, dtype, go, offset)
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


def make_arnoldi(A, b, *, precond, ip, m, orthogonalization, offset: int = 0):
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
    last_step = offset + (m + 1 if one_sync else m)  # one_sync finishes column m - 1 at step m

    def run(r, beta, tol, anorm, go, space=None):
        ctx = _Context(A=A, precond=precond, ip=ip, tol=tol, tiny=100 * jnp.finfo(real).eps,
                       offset=offset)
        V, Z = basis_V, basis_Z
        if offset:
            C, U = space
            V = tree.basis_join([C, V])
            Z = None if Z is None else tree.basis_join([U, Z])
        cy = _new_cycle(one_sync, V, Z, r, beta, anorm, go, m, dtype, offset)
        cy = steps.while_loop(ip, b, lambda c: (c.est.flag == RUNNING) & (c.k < last_step),
                                functools.partial(step, ctx=ctx), cy)
        # One-sync stores H one column to the right (a step then writes the column
        # it finishes and the new one in one update); the cycle returns it unshifted.
        p = m + offset
        H = cy.H[: p + 1, 1: p + 1] if one_sync else cy.H
        return cy.V, cy.Z, H, cy.est, cy.anorm, cy.E if one_sync else None

    return run
