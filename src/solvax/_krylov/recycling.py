"""The recycled space of GCRO-DR (`gcrot`): its refresh for a new operator and
its update from a cycle's harmonic Ritz vectors.

A recycled space is a pair of bases `(C, U)` (pytrees like `b` with a leading
axis of length `k` per leaf) with `A U = C` and `C` orthonormal. A row of both
that is zero is an unused slot: `A 0 = 0` keeps the relation, and every
projection on it is zero, so a solve starts from an empty space (all zeros)
with the same code and the same shapes as from a full one.

Only the `(m + k)`-sized dense problems are computed here, replicated on every
device, with Cholesky, triangular solves and QR (every backend, `jit`, `vmap`;
no `eig`, which runs on the CPU only). They are not differentiated: a
derivative of a solve is implicit (`_implicit.implicit_solve`: one more solve
with the transposed operator), so it never flows through the choice of the
space, which changes how fast a solve converges, not its solution.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import target, tree
from .._core.dense import cholesky, eigh, mm, qr, solve_triangular

PyTree = Any

#: Orthogonal iterations of the harmonic problem (each applies its matrix's 8th power).
SUBSPACE_ITERATIONS = 12


@jax.tree_util.register_pytree_node_class
class RecycleSpace:
    """A recycled space `A U = C`, `C^H C = I` (`Solution.recycle` of `gcrot`
    and of a recycled `pcg`). Unpacks as the pair `C, U = space`.

    Attributes:
        C: a pytree like `b` whose leaves have a leading axis of length `k`
            (the basis index): an orthonormal basis of `A span(U)`.
        U: a pytree of the same shapes with `A U = C` (for the operator of the
            solve that returned it; the next solve recomputes `C` for its own).
        ledger: `gcrot`'s record of what its solves cost, in matvecs per
            decade of residual reduction: `[cold, recycled, age]`, the last
            solve that ran without a handed-on space, the last that ran with
            one (its `k` refresh matvecs included; NaN: none yet), and the
            recycled solves since the cold cost was measured; or None (the
            space is used). `gcrot` refreshes a handed-on space only while
            recycling costs no more than running cold (`worth_refreshing`).
    Rows that are zero in both are unused slots.
    """

    def __init__(self, C: PyTree, U: PyTree, ledger: jax.Array | None = None):
        self.C, self.U, self.ledger = C, U, ledger

    def __iter__(self):
        return iter((self.C, self.U))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index):
        return (self.C, self.U)[index]

    def __repr__(self) -> str:
        return f"RecycleSpace(C={self.C!r}, U={self.U!r}, ledger={self.ledger!r})"

    def tree_flatten(self):
        return (self.C, self.U, self.ledger), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


#: Entries of a ledger: `[cold, recycled, age]`.
LEDGER = 3
#: A recycled solve whose cost is not this far below the cold reference
#: (matvecs per decade) ...
PROBE_MARGIN = 0.8
#: ... after this many recycled solves since the reference was measured
#: runs cold once instead, to measure it again: along a sequence whose
#: systems grow easier an old cold cost flatters recycling.
PROBE_AFTER = 4


def worth_refreshing(ledger: jax.Array | None) -> jax.Array | bool:
    """Whether a handed-on space is refreshed and used (`gcrot`), from its
    ledger `[cold, recycled, age]` (`RecycleSpace.ledger`): while either
    cost is unknown, or recycling (its `k` refresh matvecs included) cost no
    more than running cold, except that a narrow win (recycled above
    `PROBE_MARGIN` of cold) on a reference `PROBE_AFTER` recycled solves old
    runs cold once to measure the reference again. A space that costs more
    than it saves is dropped (the solve runs cold, without the refresh)
    until cold solves cost more."""
    if ledger is None:
        return True
    cold, recycled, age = ledger[0], ledger[1], ledger[2]
    untried = jnp.isnan(cold) | jnp.isnan(recycled)
    probe = (age >= PROBE_AFTER) & (recycled > PROBE_MARGIN * cold)
    return untried | ((recycled <= cold) & ~probe)


def empty_ledger(dtype) -> jax.Array:
    """A ledger with nothing recorded: the space is tried."""
    return jnp.array([jnp.nan, jnp.nan, 0], dtype)


def cost_per_decade(matvecs, start, final) -> jax.Array:
    """Matvecs per decade of residual reduction (`start` to `final` residual
    norms), or NaN (no verdict) for a solve that reduced it by less than a
    decade: GMRES's first steps reduce little, so a loose solve's cost per
    decade says little of a tight one's (a Newton step's early inner solves)."""
    decades = jnp.log10(start / final)
    good = (final > 0) & (decades >= 1) & jnp.isfinite(decades)
    return jnp.where(good, matvecs / jnp.where(good, decades, 1), jnp.nan)


def checked(recycle, b, k: int) -> RecycleSpace:
    """`recycle` a pair `(C, U)` of bases like `b` with `k` rows per leaf."""
    if not (isinstance(recycle, RecycleSpace)
            or (isinstance(recycle, tuple) and len(recycle) == 2)):
        raise TypeError("`recycle` must be the pair `(C, U)` of a previous solve "
                        f"(`Solution.recycle` of `gcrot` or `pcg`), not {type(recycle).__name__}.")
    ledger = recycle.ledger if isinstance(recycle, RecycleSpace) else None
    if ledger is not None and (jnp.shape(ledger) != (LEDGER,)
                               or not jnp.issubdtype(jnp.result_type(ledger), jnp.floating)):
        raise ValueError(f"`recycle.ledger` must be a float array of shape ({LEDGER},) "
                         f"(`[cold, recycled, age]`) or None, not {jnp.shape(ledger)} "
                         f"{jnp.result_type(ledger)}: pass `Solution.recycle` as it came, "
                         "or `RecycleSpace(C, U)` without one.")
    structure = jax.tree_util.tree_structure(b)
    for name, basis in zip(("C", "U"), recycle):
        if jax.tree_util.tree_structure(basis) != structure:
            raise ValueError(
                f"`recycle.{name}` must have the structure of `b` ({structure}), not "
                f"{jax.tree_util.tree_structure(basis)}: pass the space of a solve of "
                "the same kind of system.")
        for leaf, ref in zip(jax.tree_util.tree_leaves(basis), jax.tree_util.tree_leaves(b)):
            if jnp.shape(leaf) != (k, *jnp.shape(ref)):
                raise ValueError(
                    f"`recycle.{name}` has a leaf of shape {jnp.shape(leaf)} where `b`'s leaf "
                    f"{jnp.shape(ref)} and k = {k} need {(k, *jnp.shape(ref))}: a space from "
                    "another grid or another `k` (pass `k=` of the solve that made it, or "
                    "`recycle=None` to start afresh).")
            if jnp.result_type(leaf) != jnp.result_type(ref):
                raise TypeError(f"`recycle.{name}` has a {jnp.result_type(leaf)} leaf where "
                                f"`b`'s is {jnp.result_type(ref)}: recycle within one "
                                "precision.")
    return RecycleSpace(recycle[0], recycle[1], ledger)


def empty(b: PyTree, k: int) -> RecycleSpace:
    """An empty space of `k` slots for vectors like `b` (all zeros)."""
    return RecycleSpace(tree.basis_alloc(b, k), tree.basis_alloc(b, k))


def refreshed(A, ip, space: RecycleSpace) -> RecycleSpace:
    """The space for the operator `A`: `C = A U` (`k` matvecs, one compiled
    matvec mapped over the rows), then `C` orthonormalized with `U` following
    (Cholesky QR twice: two reductions of a `k x k` Gram matrix)."""
    C = lax.map(A, space.U)
    U = space.U
    for _ in range(2):
        C, U = _cholesky_qr(ip, C, U)
    return RecycleSpace(C, U)


def conjugated(A, ip, U) -> RecycleSpace:
    """The space spanned by `U` for the operator `A` (Hermitian positive
    definite), A-orthonormal: `C = A U` (`k` matvecs), then `U R^-1`,
    `C R^-1` with `U^H A U = R^H R` (one reduction), so `U^H C = I`: the form
    deflated CG (`pcg(recycle=...)`) works with."""
    C = lax.map(A, U)
    return RecycleSpace(*_normalized(lax.stop_gradient(ip.gram(U, C)), C, U))


def _cholesky_qr(ip, C, U):
    """`(C R^-1, U R^-1)` with `C^H C = R^H R`: one reduction."""
    return _normalized(lax.stop_gradient(ip.gram(C, C)), C, U)


def _normalized(G, C, U):
    """`(C R^-1, U R^-1)` with `G = R^H R` (Cholesky). Rows whose Gram entry
    is negligible against the largest (unused or dependent slots) become zero
    in both, and a factorization that fails (non-finite) empties the space."""
    d = jnp.real(jnp.diagonal(G))
    keep = d > 1e3 * jnp.finfo(d.dtype).eps * jnp.max(d)
    eye = jnp.eye(G.shape[0], dtype=G.dtype)
    G = jnp.where(keep[:, None] & keep[None, :], G, eye)
    L = cholesky(G)
    Linv = solve_triangular(L, eye, lower=True)
    # C R^-1 with R = L^H: row i of the result is sum_j conj(Linv[i, j]) C_j
    coeffs = jnp.where(keep[:, None], jnp.conj(Linv), 0)
    coeffs = jnp.where(jnp.all(jnp.isfinite(coeffs)), coeffs, 0)
    return tree.basis_mix(C, coeffs), tree.basis_mix(U, coeffs)


def harmonic_space(ip, V, Z, H, used, k: int, old: RecycleSpace, go, E=None,
                   D=None) -> RecycleSpace:
    """The space for the next cycle from the one that ran: its `k` harmonic
    Ritz vectors of smallest harmonic Ritz value (GCRO-DR's choice: the
    slowest modes of the residual polynomial).

    The cycle's relation is `A Zf = W H` with `Zf = [U, Z]` its directions,
    `W = [C, V]` its orthonormal basis and `H` the `(p + 1, p)` Hessenberg
    matrix (identity on the recycled block), `used` columns accepted. The
    harmonic Ritz pairs of `A` on `span(Zf)` solve `H^H H g = theta H^H
    W^H Zf g`: one Gram matrix (one reduction per cycle), then dense work on
    `p x p` matrices only (`_harmonic_coefficients`); the new `C = W Q`,
    `U = Zf g R^-1` from the QR `H g = Q R` (no reduction: `W` is
    orthonormal). Without a preconditioner `Zf = [U, V + D E]`, `D = C - U`
    (`arnoldi.OneSyncCycle.E`), so `W^H Zf` follows from `W^H U` alone, a
    Gram matrix of `k` columns instead of `p`. The old space is kept when no
    cycle ran (`go` false), fewer than `k` accepted directions have a
    harmonic Ritz value (an empty space's unused slots have none), or
    anything is non-finite.
    """
    p = H.shape[1]
    offset = jax.tree_util.tree_leaves(old.C)[0].shape[0]
    W = tree.tree_map(lambda leaf: leaf[: p + 1], V)

    def update(_):
        if E is None:
            Zf = tree.tree_map(lambda leaf: leaf[:p], Z)
            G = ip.gram(W, Zf)
        else:
            E_ = E[:, :p]
            WU = ip.gram(W, old.U)  # (p + 1, offset)
            # W^H (v_i + (C - U) E_i) = e_i + (W^H C - W^H U) E_i, W^H C = [I; 0]
            WD = jnp.eye(p + 1, offset, dtype=WU.dtype) - WU
            G = jnp.where(np.arange(p) < offset, jnp.pad(WU, ((0, 0), (0, p - offset))),
                          jnp.eye(p + 1, p, dtype=WU.dtype) + mm(WD, E_))
        Q, coeffs, ok = _harmonic_coefficients(lax.stop_gradient(H), lax.stop_gradient(G),
                                               used, k)
        C = tree.basis_mix(W, Q.T)
        if E is None:
            U = tree.basis_mix(Zf, coeffs.T)
        else:  # Zf g = W g + D (E g - g_C)
            U = tree.add(tree.basis_mix(W, jnp.pad(coeffs, ((0, 1), (0, 0))).T),
                         tree.basis_mix(D, (mm(E_, coeffs) - coeffs[:offset]).T))
        return tree.where(ok, RecycleSpace(C, U), old)

    if not target.branches_on_device():  # a GPU: computed and selected, no conditional
        return tree.where(go, update(None), old)
    return lax.cond(go, update, lambda _: old, None)


def _harmonic_coefficients(H, G, used, k: int):
    """`(Q, g R^-1, ok)` for `H^H H g = theta H^H G g` (`G = W^H Zf`), `g` the
    `k` vectors of smallest `|theta|`, `H g = Q R`.

    With `F = H^H H = L L^H` (positive definite: `H` has full column rank)
    the pencil is the standard problem `S h = mu h`, `S = L^-1 H^H G L^-H`,
    `mu = 1 / theta`, `g = L^-H h`; the wanted vectors span `S`'s dominant
    invariant subspace, found by orthogonal iteration (QR and products only,
    in real or complex arithmetic). Columns beyond `used` are replaced by unit
    vectors in `H` and by zero in `S`: they are eigenvectors with `mu = 0`,
    never among the `k` largest while `used` has `k` columns.
    """
    p = H.shape[1]
    rows, cols = np.indices((p + 1, p), dtype=np.int32)
    live = np.arange(p, dtype=np.int32) < used
    Hb = jnp.where(cols < used, H, (rows == cols + 1).astype(H.dtype))
    M = mm(jnp.conj(Hb.T), jnp.where(cols < used, G, 0))
    M = jnp.where(live[:, None] & live[None, :], M, 0)
    L = cholesky(mm(jnp.conj(Hb.T), Hb))
    T = solve_triangular(L, M, lower=True)  # L^-1 M
    S = jnp.conj(solve_triangular(L, jnp.conj(T.T), lower=True).T)  # L^-1 M L^-H
    X = _dominant_subspace(S, k)
    g = solve_triangular(jnp.conj(L.T), X, lower=False)  # L^-H X
    Q, R = qr(mm(Hb, g))
    coeffs = jnp.conj(solve_triangular(jnp.conj(R.T), jnp.conj(g.T), lower=True).T)  # g R^-1
    # at least k live directions with mu != 0 (an unused slot's column of M is 0)
    enough = jnp.sum(live & (jnp.sum(jnp.abs(M), axis=0) > 0)) >= k
    ok = enough & jnp.all(jnp.isfinite(Q)) & jnp.all(jnp.isfinite(coeffs))
    return Q, coeffs, ok


def _dominant_subspace(S, k: int):
    """An orthonormal basis of the invariant subspace of `S` for its `k`
    eigenvalues of largest modulus: orthogonal iteration with `S^8`
    (normalized at each squaring), from a fixed generic start."""
    P = S / jnp.maximum(jnp.linalg.norm(S), jnp.finfo(jnp.real(S).dtype).tiny)
    for _ in range(3):
        P = mm(P, P)
        P = P / jnp.maximum(jnp.linalg.norm(P), jnp.finfo(jnp.real(P).dtype).tiny)
    start = np.random.default_rng(0).standard_normal((S.shape[0], k))
    X = qr(jnp.asarray(start, S.dtype))[0]
    X = lax.fori_loop(0, SUBSPACE_ITERATIONS, lambda _, X: qr(mm(P, X))[0], X)
    return qr(mm(S, X))[0]


def ritz_space(ip, U, C, P, Q, curvatures, k: int, old: RecycleSpace) -> RecycleSpace:
    """Deflated CG's space for the next solve: Rayleigh–Ritz on `span(Z)`,
    `Z = [U, P]` (the space that deflated this solve and the solve's first
    search directions `P`, `Q = A P`), keeping the `k` Ritz vectors of
    smallest Ritz value (the slowest modes).

    The directions are A-conjugate to each other and to the A-orthonormal
    `U`, so `Z^H A Z = diag(d)` is known (`d = 1` on `U`, the steps'
    curvatures `<p, A p>` on `P`): only `G = Z^H Z` is reduced (one
    reduction per solve). With `s = d^-1/2`, the `k` largest eigenvectors `w`
    of `S = s G s` (`eigh`, every backend) give `y = s w` and the new `U = Z
    y`, `C = [C, Q] y`, A-orthonormal (`y^H diag(d) y = I`). Slots without a
    live vector stay zero (unused); anything non-finite keeps `old`."""
    Z = tree.basis_join([U, P])
    AZ = tree.basis_join([C, Q])
    G = lax.stop_gradient(ip.gram(Z, Z))
    real = jnp.real(G).dtype
    norms = jnp.real(jnp.diagonal(G))
    # Z^H A Z: 1 on the A-orthonormal U, the curvatures on the directions
    d = jnp.ones((G.shape[0],), real).at[G.shape[0] - curvatures.shape[0]:].set(
        lax.stop_gradient(curvatures).astype(real))
    live = (d > 0) & jnp.isfinite(d) & (norms > 1e3 * jnp.finfo(real).eps * jnp.max(norms))
    s = jnp.where(live, 1 / jnp.sqrt(jnp.where(live, d, 1)), 0).astype(G.dtype)
    S = s[:, None] * G * s[None, :]
    S = (S + jnp.conj(S.T)) / 2
    values, vectors = eigh(S)
    values, vectors = values[-k:], vectors[:, -k:]   # the largest: the smallest Ritz values
    wanted = values > 1e3 * jnp.finfo(real).eps * jnp.maximum(jnp.max(values), 0)
    y = jnp.where(wanted[None, :], s[:, None] * vectors, 0)
    ok = jnp.all(jnp.isfinite(y))
    new = RecycleSpace(tree.basis_mix(AZ, y.T), tree.basis_mix(Z, y.T))
    return tree.where(ok, new, old)
