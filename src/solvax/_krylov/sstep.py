"""s-step (communication-avoiding) conjugate gradients: one reduction per s steps.

`pcg(method="s_step", s=...)` runs here. Each outer step does s CG steps at
once, in the block form of Chronopoulos & Gear (1989):

1. Krylov block. From `z = M r`, s vectors `V = [v_0, ..., v_{s-1}]` spanning
   `K_s(M A, z)` by a three-term polynomial recurrence (`_recurrence`:
   Chebyshev, Newton or monomial), with `A V` from s matvecs; `Y = M^{-1} V`
   rides along by the same recurrence on `A V` (no `M^{-1}` is applied).
2. One reduction. `[V, Q, x, r]^H [A V, r, Y_1, ..]` in **one** `gram`
   call: `V^H A V`, `Q^H A V`, `V^H r`, `Q^H r`, `<r, r>` and (when the
   spectrum is estimated) `V^H Y`, where `Q` is the previous outer step's
   block of directions (kept with `A Q`).
3. Locally, on s x s matrices: `B = W^+ Q^H A V` (W = Q^H A Q, carried),
   `P = V - Q B` (A-orthogonal to every earlier block, as CG's directions
   are), `W' = P^H A P = V^H A V - (Q^H A V)^H B` and the step
   `a = W'^+ P^H r`; then `x += P a`, `r -= A P a`. In exact arithmetic
   `x` is CG's iterate after s more steps (the A-norm of the error is
   minimized over the same Krylov space), with s matvecs and s preconditioner
   applications, as many as s CG steps.

Finite precision. The s x s solves are spectral, on the diagonally scaled
matrix: directions whose scaled eigenvalue is below `eps**_RANK_POWER` of the
largest are left out (the basis lost rank there; the step is still a Galerkin
step on what is left), a clearly negative one is `INDEFINITE`, and a block
with no direction left stops as `BREAKDOWN`. `A P` is updated by recurrence,
so `r` drifts from `b - A x` as in any CG: the stopping test is confirmed on
the true residual (`_rounds`), and `residual_replacement` also recomputes it
every so many outer steps.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import checks, contract, driver, reduce, target, tree
from .._core.contract import Outcome, Problem
from .._core.dense import eigh, eigvalsh, mm
from .._core.solution import RUNNING, Status, code, first_status
from . import steps

PyTree = Any

BASES = ("chebyshev", "newton", "monomial")

#: A scaled eigenvalue below -eps**this of the largest is negative curvature
#: (`INDEFINITE`): 1.2e-4 in float64, 1.8e-2 for a float32 leaf.
_NEGATIVE_POWER = 1 / 4

#: Outer steps whose Ritz values update the basis interval (spectrum not given).
_RITZ_STEPS = 4

#: Scaled eigenvalues of a Gram matrix below this fraction of the largest are
#: treated as lost rank (about 1e-10 in float64, 4e-5 in float32).
_RANK_POWER = 5 / 8


class _State(NamedTuple):
    QX: PyTree  # basis [Q; x]: the previous outer step's directions P (s rows), then x
    AQR: PyTree  # basis [A Q; r]: A Q by recurrence, then the recursive residual b - A x
    W: tuple  # `_spectral(Q^H A Q)`: the previous step's, reused for `B`
    center: jax.Array  # the basis polynomials' interval [center - half, center + half]
    half: jax.Array
    lmax: jax.Array  # largest Ritz value seen (when estimating; 0 before the first)
    tol2: jax.Array  # squared stopping threshold
    rr: jax.Array  # <r, r> at the top of the last outer step
    k: jax.Array  # outer steps that updated x
    status: jax.Array  # RUNNING, or why the loop stopped
    go: jax.Array  # the last outer step updated x
    checks: steps.Confirmation  # confirming convergence on the true residual
    history: jax.Array | None


class _Context(NamedTuple):
    A: Any
    M: Any
    identity: bool
    ip: reduce.Reduction
    s: int
    basis: str
    estimate: bool  # spectrum from the Ritz values of each block (else given)
    eps: float  # of the least precise leaf: it limits every product
    rtol: jax.Array
    atol: jax.Array
    tol_from_rr: bool
    max_outer: int
    replace_every: int | None
    b: PyTree


def leja_order(nodes: np.ndarray) -> np.ndarray:
    """`nodes` in Leja order: the largest in modulus first, then each next one
    maximizing the product of distances to those before (keeps the Newton
    basis's factors from growing or shrinking together)."""
    nodes = np.asarray(nodes, float)
    order = [int(np.argmax(np.abs(nodes)))]
    for _ in range(len(nodes) - 1):
        dist = np.prod([np.abs(nodes - nodes[i]) for i in order], axis=0)
        dist[order] = -1
        order.append(int(np.argmax(dist)))
    return nodes[order]


def _recurrence(basis: str, s: int, center, half):
    """`(alpha, beta, gamma)` with `v_{j+1} = (M A v_j - alpha_j v_j -
    beta_j v_{j-1}) / gamma_j`, j = 0..s-2, for polynomials on the interval
    `[center - half, center + half]`: Chebyshev `T_j` of the shifted and
    scaled operator; Newton with shifts at the Chebyshev nodes in Leja order;
    monomial `(M A)^j` (for comparison only: its conditioning grows
    exponentially with s)."""
    j = max(s - 1, 1)
    ones = jnp.ones((j,), jnp.result_type(center))
    if basis == "monomial":
        return 0 * ones, 0 * ones, ones
    if basis == "newton":
        nodes = leja_order(np.cos((2 * np.arange(j) + 1) * np.pi / (2 * j)))
        return center + half * jnp.asarray(nodes, ones.dtype), 0 * ones, half * ones
    gamma = (half / 2) * ones.at[0].set(2)
    return center * ones, gamma.at[0].set(0) if j else gamma, gamma


def _block(st: _State, ctx: _Context, r, z):
    """`V`, `A V` and `Y = M^{-1} V` (lists of s vectors) from `z = M r`."""
    alpha, beta, gamma = _recurrence(ctx.basis, ctx.s, st.center, st.half)
    V, AV, Y = [z], [], [r]
    for j in range(ctx.s):
        with jax.named_scope("solvax.pcg.matvec"):
            AV.append(ctx.A(V[j]))
        if j == ctx.s - 1:
            break
        with jax.named_scope("solvax.pcg.precond"):
            MAv = AV[j] if ctx.identity else ctx.M(AV[j])

        def next_(w, prev, j=j):
            out = tree.axpy(-alpha[j], prev[j], w)
            if j:
                out = tree.axpy(-beta[j], prev[j - 1], out)
            return tree.scale(1 / gamma[j], out)

        V.append(next_(MAv, V))
        if not ctx.identity and ctx.estimate:
            Y.append(next_(AV[j], Y))
    return V, AV, V if ctx.identity else Y


def _hermitian(X):
    return (X + jnp.conj(X.T)) / 2


def _spectral(W, eps):
    """`(U, lam, d, keep)`: `diag(d) W diag(d) = U diag(lam) U^H` with `d` the
    inverse square roots of W's diagonal (0 where it is not positive), and the
    eigenvalues kept as numerically nonzero."""
    diag = jnp.real(jnp.diagonal(W))
    d = jnp.where(diag > 0, 1 / jnp.sqrt(jnp.where(diag > 0, diag, 1)), 0).astype(W.dtype)
    lam, U = eigh(_hermitian(d[:, None] * W * d[None, :]))
    top = jnp.max(jnp.abs(lam))
    keep = lam > eps ** _RANK_POWER * top
    return U, lam, d, keep


def _pinv_times(spec, rhs):
    """`W^+ rhs` (rhs a vector or a matrix) from `_spectral(W)`."""
    U, lam, d, keep = spec
    inv = jnp.where(keep, 1 / jnp.where(keep, lam, 1), 0).astype(U.dtype)
    rhs2 = rhs if rhs.ndim == 2 else rhs[:, None]
    out = d[:, None] * mm(U, inv[:, None] * mm(jnp.conj(U.T), d[:, None] * rhs2))
    return out if rhs.ndim == 2 else out[:, 0]


def _largest_ritz(G, N, eps):
    """The largest eigenvalue of the pencil `(G, N)` (`G = V^H A V`,
    `N = V^H M^{-1} V`): a lower bound of `M A`'s largest eigenvalue, close
    after a few Krylov steps. Directions where `N` lost rank are left out."""
    U, lam, d, keep = _spectral(N, eps)
    root = jnp.where(keep, 1 / jnp.sqrt(jnp.where(keep, lam, 1)), 0).astype(U.dtype)
    S = d[:, None] * U * root[None, :]  # N^{-1/2} on the kept directions
    return jnp.max(eigvalsh(_hermitian(mm(mm(jnp.conj(S.T), G), S))))


def _coordinates(W, XZ, s: int, eps: float):
    """The s x s algebra of an outer step, from its Gram block `XZ`:
    `P = V - Q B` (A-orthogonal to the previous directions Q, whose `Q^H A Q`
    has the spectral data `W`), `P^H A P` (`Wn`) with its spectral data, and
    the step `a` solving `P^H A P a = P^H r`."""
    G, C = XZ[:s, :s], XZ[s:2 * s, :s]  # V^H A V, Q^H A V
    Vr, Qr = XZ[:s, s], XZ[s:2 * s, s]  # V^H r, Q^H r
    B = _pinv_times(W, C)  # (s, s); 0 at the first step (Q = 0)
    Wn = _hermitian(G - mm(jnp.conj(C.T), B))  # P^H A P
    spec = _spectral(Wn, eps)
    a = _pinv_times(spec, Vr - mm(jnp.conj(B.T), Qr))
    return B, Wn, spec, a


def _step_status(rr, tol2, Wn, spec, eps: float):
    """Why the outer step stops (`RUNNING` if it does not), and whether its
    data are finite."""
    _, lam, _, keep = spec
    finite = jnp.isfinite(rr) & jnp.all(jnp.isfinite(Wn))
    # clearly negative curvature; smaller negative eigenvalues are rounding in a
    # basis that lost rank (measured: float32 on jax 0.4.38 near the end of a
    # solve of the condition-660 1-D Poisson test) and are dropped with it
    indefinite = jnp.min(lam) < -(eps ** _NEGATIVE_POWER) * jnp.max(jnp.abs(lam))
    status = first_status([(~finite, Status.NONFINITE), (rr <= tol2, Status.CONVERGED),
                           (indefinite, Status.INDEFINITE), (~jnp.any(keep), Status.BREAKDOWN)],
                          RUNNING)
    return status, finite


def _next_bases(X, AV, AQR, B, a, s: int):
    """One pass over `X = [V, Q, x, r]` gives `[P; x + P a]` (`P = V - Q B`),
    one over `[A V, A Q, r]` gives `[A P; r - A P a]`."""
    Ba = mm(B, a)
    K = (jnp.zeros((s + 1, 2 * s + 2), B.dtype).at[:s, :s].set(jnp.eye(s, dtype=B.dtype))
         .at[:s, s:2 * s].set(-B.T).at[s, :s].set(a).at[s, s:2 * s].set(-Ba).at[s, 2 * s].set(1))
    QX = tree.basis_mix(X, K)
    AX = tree.basis_join([tree.basis_of(AV), AQR])
    KA = K[:, :2 * s + 1].at[s, :2 * s].multiply(-1)  # ... r - (A V a - A Q B a)
    return QX, tree.basis_mix(AX, KA)


def _outer_step(st: _State, ctx: _Context) -> _State:
    eps = ctx.eps
    s = ctx.s
    x, r = tree.basis_get(st.QX, s), tree.basis_get(st.AQR, s)
    if ctx.replace_every:
        r = lax.cond((st.k > 0) & (st.k % ctx.replace_every == 0),
                     lambda: tree.sub(ctx.b, ctx.A(x)), lambda: r)
    with jax.named_scope("solvax.pcg.precond"):
        z = r if ctx.identity else ctx.M(r)
    V, AV, Y = _block(st, ctx, r, z)
    # X = [V, Q, x, r] and Z = [A V, r, Y_1..]: the step's products are X^H Z
    X = tree.basis_join([tree.basis_of(V), st.QX, tree.basis_of([r])])
    Z = tree.basis_of(AV + [r] + (Y[1:] if ctx.estimate else []))
    with jax.named_scope("solvax.pcg.reduce"):
        XZ = ctx.ip.gram(X, Z)
    rr = jnp.real(XZ[2 * s + 1, s])

    tol2 = st.tol2
    if ctx.tol_from_rr:
        tol2 = jnp.where(st.k == 0, contract.squared_threshold(rr, ctx.rtol, ctx.atol), tol2)
    history = st.history
    if history is not None:
        history = history.at[st.k * s].set(reduce.real_sqrt(rr))

    B, Wn, spec, a = _coordinates(st.W, XZ, s, eps)
    status, finite = _step_status(rr, tol2, Wn, spec, eps)
    retry, rayleigh = _first_block_overflowed(st, ctx, XZ, finite)
    status = jnp.where(retry, RUNNING, status)
    # the own residual's convergence is confirmed on the true one (`_rounds`)
    confirmed = st.checks.after_step(status == code(Status.CONVERGED), rr, tol2)
    status = jnp.where(confirmed.stalled, code(Status.STAGNATION), status)
    go = (status == RUNNING) & (st.k < ctx.max_outer)
    update = go & ~retry
    a = jnp.where(update, a, 0)  # a step that does not go leaves x and r as they are
    QX, AQR = _next_bases(X, AV, st.AQR, B, a, s)
    center, half, lmax = _interval(st, ctx, XZ, finite, retry, rayleigh)
    # a retried step keeps the bases and the previous block's data
    QX, AQR, spec = tree.where(retry, (st.QX, st.AQR, st.W), (QX, AQR, spec))
    return _State(
        QX=QX, AQR=AQR, W=spec,
        center=center, half=half, lmax=lmax, tol2=tol2, rr=rr,
        k=st.k + update.astype(st.k.dtype),
        status=status, go=go, checks=confirmed, history=history)


def _first_block_overflowed(st: _State, ctx: _Context, XZ, finite):
    """`(retry, rayleigh)`. The first block's basis is unscaled (no spectrum
    known yet): its Gram matrix grows like lambda_max^(2s-1) and overflowed
    float32 (and a TPU's emulated float64, float32's range) for a 128^2
    Laplacian (lambda_max 1.3e5). Such a step is retried (`_interval`) on
    the interval of twice the Rayleigh quotient z^H A z / z^H M^-1 z (a lower
    bound of lambda_max; a retry that overflows again quadruples it): s
    matvecs and one reduction more, in the same loop (no collective added),
    x unchanged. With a given spectrum the basis is scaled: never."""
    if not ctx.estimate:
        return jnp.zeros((), bool), None
    rayleigh = jnp.real(XZ[0, 0]) / jnp.real(XZ[0, ctx.s])
    return (st.k == 0) & ~finite & jnp.isfinite(rayleigh) & (rayleigh > 0), rayleigh


def _interval(st: _State, ctx: _Context, XZ, finite, retry, rayleigh):
    """`(center, half, lmax)` of the next block's basis polynomials: when
    estimating, Chebyshev/Newton on [0, 1.1 lmax] (Ritz values lie below
    lmax), lmax from the block's Ritz values, or on a retry
    (`_first_block_overflowed`) from the Rayleigh quotient."""
    if not ctx.estimate:
        return st.center, st.half, st.lmax
    real, s = st.tol2.dtype, ctx.s
    G, N = XZ[:s, :s], XZ[:s, s:2 * s]  # V^H A V, V^H Y with Y_0 = r
    # The largest Ritz value of a block settles within a few blocks; later
    # ones would cost two small eigensolves per step for little (measured:
    # 0.35x -> 0.30x jax.scipy's cg per iteration on the latency-bound mesh).
    def ritz():
        return jnp.maximum(st.lmax, jnp.where(finite, _largest_ritz(G, N, ctx.eps), 0)
                           ).astype(real)

    early = st.k < _RITZ_STEPS
    # a GPU copies a conditional's index to the host: there the small
    # eigensolve runs every block and is selected (`target.branches_on_device`)
    lmax = (lax.cond(early, ritz, lambda: st.lmax) if target.branches_on_device()
            else jnp.where(early, ritz(), st.lmax))
    lmax = jnp.where(retry, jnp.maximum(4 * st.lmax, 2 * rayleigh), lmax).astype(real)
    center = jnp.where(lmax > 0, 0.55 * lmax, st.half).astype(real)
    return center, center, lmax


def _restart(st: _State, ctx: _Context) -> _State:
    """s-step CG restarted from `x`: `r = b - A x` (one matvec, no
    reduction), no previous block."""
    s = ctx.s
    with jax.named_scope("solvax.pcg.restart"):
        x = tree.basis_get(st.QX, s)
        r = tree.sub(ctx.b, ctx.A(x))
        zeros = tree.basis_alloc(r, s)
        return st._replace(QX=tree.basis_join([zeros, tree.basis_of([x])]),
                           AQR=tree.basis_join([zeros, tree.basis_of([r])]),
                           W=_spectral(jnp.zeros_like(st.W[0]), ctx.eps),
                           status=jnp.full_like(st.status, RUNNING), go=st.checks.pending,
                           checks=st.checks.restarted())


def _rounds(st: _State, ctx: _Context) -> _State:
    """Outer steps in rounds whose stopping test is confirmed on the true
    residual (`steps.Confirmation`; the restart: one matvec, no reduction)."""
    return steps.confirmed_rounds(ctx.ip, ctx.b, st, checks=lambda st: st.checks,
                                    going=lambda st: st.go,
                                    step=functools.partial(_outer_step, ctx=ctx),
                                    restart=lambda st: _restart(st, ctx))


def _run(problem: Problem, *, s: int, basis: str, max_steps: int | None,
         residual_replacement: int | None, record_history: bool) -> Outcome:
    real = problem.real_dtype()
    dtype = tree.result_dtype(problem.b)
    max_steps = problem.step_limit(max_steps)
    rtol, atol = problem.tolerances()
    identity = problem.precond is None
    estimate = problem.data is None
    ctx = _Context(A=problem.A, M=(lambda v: v) if identity else problem.precond,
                   identity=identity, ip=problem.ip, s=s, basis=basis, estimate=estimate,
                   eps=max(float(jnp.finfo(leaf.dtype).eps)
                           for leaf in jax.tree_util.tree_leaves(problem.b)),
                   rtol=rtol, atol=atol, tol_from_rr=problem.x0 is None,
                   max_outer=-(-max_steps // s), replace_every=residual_replacement,
                   b=problem.b)
    b = problem.b
    with jax.named_scope("solvax.pcg.setup"):
        x, r, tol2 = problem.start(rtol, atol)
    if estimate:  # the first block is a monomial one; then from Ritz values
        center, half = jnp.zeros((), real), jnp.ones((), real)
    else:
        lmin, lmax = (jnp.asarray(v, real) for v in problem.data)
        center, half = (lmax + lmin) / 2, (lmax - lmin) / 2
    one = jnp.ones((), real)
    zeros = tree.basis_alloc(b, s)
    st = _State(QX=tree.basis_join([zeros, tree.basis_of([x])]),
                AQR=tree.basis_join([zeros, tree.basis_of([r])]),
                W=_spectral(jnp.zeros((s, s), dtype), ctx.eps),
                center=center, half=half, lmax=jnp.zeros((), real), tol2=tol2, rr=one,
                k=jnp.int32(0), status=jnp.int32(RUNNING), go=jnp.bool_(True),
                checks=steps.Confirmation.start(real),
                history=problem.history(ctx.max_outer * s + 1, record_history))
    st = _rounds(st, ctx)
    history = st.history
    if history is not None:
        history = history[: max_steps + 1]
    return Outcome(x=tree.basis_get(st.QX, s), status=st.status,
                   iterations=jnp.minimum(st.k * s, max_steps), history=history)


S_STEP = driver.register(contract.Method("pcg_s_step", _run))


def solve(matvec, b, *, x0, precond, rtol, atol, max_steps, s, basis, spectrum,
          residual_replacement, record_history, inner_product, axis_name, failed_derivative):
    """`pcg(method="s_step")`: its options checked, then the driver."""
    checks.check_int("s", s, 1)
    checks.check_choice("basis", basis, BASES)
    data = None
    if spectrum is not None:
        if not (isinstance(spectrum, tuple | list) and len(spectrum) == 2):
            raise TypeError("`spectrum` must be a pair `(lmin, lmax)` bounding the eigenvalues "
                            f"of `M A` (e.g. from `solvax.estimate_spectrum`); got {spectrum!r}.")
        data = tuple(jnp.asarray(v) for v in spectrum)
        for name, v in zip(("lmin", "lmax"), data):
            if v.shape != () or not jnp.issubdtype(v.dtype, jnp.number) \
                    or jnp.issubdtype(v.dtype, jnp.complexfloating):
                raise TypeError(f"`spectrum` {name} must be a real scalar; got {v!r}.")
        if not any(isinstance(v, jax.core.Tracer) for v in data):
            lmin, lmax = (float(v) for v in data)
            if not 0 <= lmin < lmax:
                raise ValueError("`spectrum` must satisfy 0 <= lmin < lmax (the eigenvalues of "
                                 f"M A are positive); got ({lmin}, {lmax}).")
    return driver.solve(S_STEP, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, data=data, s=s, basis=basis,
                         max_steps=max_steps, residual_replacement=residual_replacement,
                         record_history=record_history)
