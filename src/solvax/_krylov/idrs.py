"""IDR(s) with biorthogonalization on pytrees: one synchronization per matvec."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import checks, contract, driver, reduce, tree
from .._core.contract import Outcome, Problem
from .._core.dense import mm, solve_triangular
from .._core.options import documented
from .._core.registry import Row, Variant, register_solver
from .._core.solution import RUNNING, Solution, Status, code, first_status
from . import steps
from .steps import masked_div, negligible, nonzero

PyTree = Any



class _State(NamedTuple):
    x: PyTree
    r: PyTree  # b - A x (recursively updated)
    # Tuples of s vectors, not stacked bases: the cycle is unrolled, so column j
    # is a static index and replacing it copies nothing (XLA copies a stacked
    # basis whole for an in-place column update, several times per step).
    G: tuple  # A U, biorthogonal to the shadow space
    U: tuple  # (preconditioned) directions
    Mp: jax.Array  # P^H G, (s, s), lower triangular
    f: jax.Array  # P^H r, (s,)
    omega: jax.Array
    k: jax.Array  # matvecs that updated x
    go: jax.Array
    status: jax.Array
    history: jax.Array | None
    start: jax.Array  # squared true residual the round started from (inf at the start)


class _Context(NamedTuple):
    A: Callable
    M: Callable
    ip: reduce.Reduction
    P: PyTree  # the shadow space (leaves (s, ...))
    s: int
    angle: float  # the safeguard kappa of omega (0: the plain minimal-residual step)
    tol2: jax.Array
    max_steps: int


def shadow_space(b: PyTree, s: int, key, axes: tuple = (), size: int | None = None) -> PyTree:
    """`s` random vectors shaped like `b`, generated leaf by leaf (leaves
    `(s, *leaf.shape)`): leaf `i` from `fold_in(key, i)`, normal entries
    (complex for a complex leaf) of variance `1 / size` (default: `b`'s
    size; inside `shard_map` pass the global one), so no leaf is
    gathered and the space is the same on every run. Inside `shard_map` the
    key is also folded with each shard's index along `axes`, so the shards
    hold different pieces. The draws are float32 (then cast): a 64-bit draw
    bitcasts 64-bit random bits, which a TPU cannot lower for float64, and
    a shadow space needs no more than float32's randomness."""
    for name in axes:
        key = jax.random.fold_in(key, lax.axis_index(name))
    size = tree.size(b) if size is None else size
    leaves, treedef = jax.tree_util.tree_flatten(b)
    out = []
    for i, leaf in enumerate(leaves):
        k = jax.random.fold_in(key, i)
        real = jnp.finfo(leaf.dtype).dtype
        real = real if real.itemsize >= 4 else jnp.dtype(jnp.float32)
        draw = jax.random.normal(k, (s, *leaf.shape), jnp.float32).astype(real)
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            imag = jax.random.normal(jax.random.fold_in(k, 1), (s, *leaf.shape), jnp.float32)
            draw = lax.complex(draw, imag.astype(real)) * jnp.asarray(np.sqrt(0.5), real)
        out.append((draw * jnp.asarray(1 / np.sqrt(size), real)).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _combine(vectors: tuple, coeffs) -> PyTree:
    """`sum_i coeffs[i] vectors[i]` (zero for no vectors), one pass per leaf."""
    def combine(*leaves):
        return sum(tree.like(coeffs[i], leaf) * leaf for i, leaf in enumerate(leaves))

    return jax.tree_util.tree_map(combine, *vectors)


def _guard(ok, value):
    """`value` where `ok` holds, else zeros: a step that is not taken moves nothing
    (and a NaN of a coefficient it did not need stays out)."""
    return jnp.where(ok, value, jnp.zeros_like(value))


def _inner_step(st: _State, j: int, ctx: _Context) -> _State:
    """Step `j` of a cycle: a new column `G_j = A U_j` in the current IDR space,
    biorthogonalized against `P_0..P_{j-1}`; its `s` products `P^H G_j` and the
    check of the current residual `<r, r>` in one reduction."""
    index = jnp.arange(ctx.s)
    c = _guard(st.go, solve_triangular(st.Mp[j:, j:], st.f[j:], lower=True))
    v = tree.sub(st.r, _combine(st.G[j:], c))
    with jax.named_scope("solvax.idrs.precond"):
        v = ctx.M(v)
    u = tree.axpy(st.omega, v, _combine(st.U[j:], c))
    with jax.named_scope("solvax.idrs.matvec"):
        g = ctx.A(u)
    with jax.named_scope("solvax.idrs.reduce"):
        pg, (rr,) = ctx.ip.project_many(ctx.P, [g], [(st.r, st.r)])
    pg, rr = pg[0], jnp.real(rr)
    column = pg
    if j:  # G_j -= G alpha, U_j -= U alpha with Mp[:j, :j] alpha = (P^H G_j)[:j]
        alpha = _guard(st.go, solve_triangular(st.Mp[:j, :j], pg[:j], lower=True))
        g = tree.sub(g, _combine(st.G[:j], alpha))
        u = tree.sub(u, _combine(st.U[:j], alpha))
        column = pg - mm(st.Mp[:, :j], alpha)
    column = jnp.where(index >= j, column, 0)  # P^H G_j, biorthogonalized
    pivot = column[j]
    # P_j^H G_j ~ 0 next to |P^H G_j| (the vectors are normalized alike): IDR's breakdown
    lost = negligible(pivot, jnp.max(jnp.abs(pg)))
    finite = jnp.isfinite(rr) & jnp.all(jnp.isfinite(jnp.abs(pg)))
    take, status = _decide(st, ctx, rr, finite, lost)
    beta = masked_div(take, st.f[j], pivot)
    return st._replace(
        x=tree.axpy(beta, u, st.x), r=tree.axpy(-beta, g, st.r),
        G=(*st.G[:j], g, *st.G[j + 1:]), U=(*st.U[:j], u, *st.U[j + 1:]),
        Mp=st.Mp.at[:, j].set(jnp.where(take, column, st.Mp[:, j])),
        f=jnp.where(index > j, st.f - beta * column, st.f),
        k=st.k + take.astype(jnp.int32), go=take, status=status,
        history=_record(st, rr))


def _omega_step(st: _State, ctx: _Context) -> _State:
    """The cycle's last step: `x += omega M r`, `r -= omega A M r` with the
    minimal-residual `omega` (enlarged to keep the angle between `t` and `r`
    off zero when `ctx.angle > 0`); `P^H r`, `P^H t`
    and `<t, r>, <t, t>, <r, r>` in one reduction give the next cycle's
    `f = P^H r` without one of its own."""
    with jax.named_scope("solvax.idrs.precond"):
        v = ctx.M(st.r)
    with jax.named_scope("solvax.idrs.matvec"):
        t = ctx.A(v)
    with jax.named_scope("solvax.idrs.reduce"):
        (pr, pt), (tr, tt, rr) = ctx.ip.project_many(ctx.P, [st.r, t],
                                                     [(t, st.r), (t, t), (st.r, st.r)])
    tt, rr = jnp.real(tt), jnp.real(rr)
    norms = reduce.real_sqrt(tt) * reduce.real_sqrt(rr)
    lost = negligible(tr, norms)  # t orthogonal to r: omega = 0 stalls IDR
    finite = jnp.isfinite(rr) & jnp.isfinite(tt) & jnp.isfinite(jnp.abs(tr))
    omega = tr / nonzero(tt).astype(tr.dtype)
    angle = jnp.abs(tr) / nonzero(norms)
    kappa = jnp.asarray(ctx.angle, angle.dtype)
    omega = omega * jnp.where(angle < kappa, kappa / jnp.where(lost, 1, angle), 1).astype(
        omega.dtype)
    take, status = _decide(st, ctx, rr, finite, lost)
    step = _guard(take, omega)
    return st._replace(x=tree.axpy(step, v, st.x), r=tree.axpy(-step, t, st.r),
                       f=jnp.where(take, pr - omega * pt, st.f),
                       omega=jnp.where(take, omega, st.omega), k=st.k + take.astype(jnp.int32),
                       go=take, status=status, history=_record(st, rr))


def _decide(st: _State, ctx: _Context, rr, finite, lost):
    """`(take, status)` of a step whose reduction measured `rr = <r, r>` of the
    residual it starts from: converged, out of steps (it only checked), or a
    breakdown; a loop that already stopped keeps its status."""
    done, limit = rr <= ctx.tol2, st.k >= ctx.max_steps
    status = first_status([(done, Status.CONVERGED), (limit, RUNNING),
                           (~finite, Status.NONFINITE), (lost, Status.BREAKDOWN)], RUNNING)
    take = st.go & (status == RUNNING) & ~limit
    return take, jnp.where(st.go, status, st.status)


def _record(st: _State, rr):
    if st.history is None:
        return None
    return st.history.at[st.k].set(jnp.where(st.go, reduce.real_sqrt(rr), st.history[st.k]))


def _cycle(st: _State, ctx: _Context) -> _State:
    """s steps in the IDR space and the step that shrinks it: s + 1 matvecs and
    s + 1 reductions (steps after the loop stopped take no effect)."""
    for j in range(ctx.s):
        st = _inner_step(st, j, ctx)
    return _omega_step(st, ctx)


def _run(problem: Problem, *, s: int, seed: tuple, angle: float, max_steps: int | None,
         record_history: bool) -> Outcome:
    """The IDR(s) iteration (not differentiated itself; see `idrs`)."""
    max_steps = problem.step_limit(max_steps)
    rtol, atol = problem.tolerances()
    b, ip = problem.b, problem.ip
    key = (jax.random.PRNGKey(seed[1]) if seed[0] == "seed"
           else jnp.asarray(seed[1:], jnp.uint32))
    P = shadow_space(b, s, key, ip.reduced_axes(), problem.size())
    with jax.named_scope("solvax.idrs.setup"):
        x, r = problem.residual()
        f, (rr, bb) = ip.project_many(P, [r], [(r, r), (b, b)])
        bb = jnp.real(bb)
        x, r = problem.settled(x, r, bb)
        if problem.x0 is not None:  # from zero, f = P^H b is 0 for b = 0 already
            f = jnp.where(bb == 0, jnp.zeros_like(f), f)
    tol2 = contract.squared_threshold(bb, rtol, atol)
    ctx = _Context(A=problem.A, M=problem.precond or (lambda v: v), ip=ip, P=P, s=s,
                   angle=angle, tol2=tol2, max_steps=max_steps)
    dtype = tree.result_dtype(b)
    state = _restarted(None, x, r, f[0].astype(dtype), s, dtype)._replace(
        history=problem.history(max_steps + 1, record_history))
    state = steps.while_loop(ip, b, lambda st: st.go,
                             functools.partial(_confirmed_round, ctx=ctx, b=b), state,
                             per_step=False)
    return Outcome(x=state.x, status=state.status, iterations=state.k, history=state.history)


def _restarted(st: _State | None, x, r, f, s: int, dtype) -> _State:
    """A fresh IDR space at `(x, r)` with `f = P^H r` (the start, or a restart
    from the true residual; `st`: the state it continues, for `k` and the
    history)."""
    zeros = tuple(tree.zeros_like(r) for _ in range(s))
    fresh = _State(x=x, r=r, G=zeros, U=zeros, Mp=jnp.eye(s, dtype=dtype), f=f,
                   omega=jnp.ones((), dtype), k=jnp.int32(0), go=jnp.bool_(True),
                   status=jnp.int32(RUNNING), history=None,
                   start=jnp.full((), jnp.inf, jnp.finfo(dtype).dtype))
    return fresh if st is None else fresh._replace(k=st.k, history=st.history)


def _confirmed_round(st: _State, ctx: _Context, b) -> _State:
    """Cycles until IDR's own test stops them, then the stop confirmed on the
    true residual: where its own residual met the tolerance, `r = b - A x`
    (one matvec) and `P^H r` with `<r, r>` (one reduction). The true one
    meeting it ends the solve; one that fell below half of the last round's
    own starts another round from it (a fresh IDR space: the recursive
    residual of IDR(s) drifts from the true one by the rounding of the
    largest residuals it passed, measured 34x the tolerance of 1e-10 on a
    rotating-wind convection-diffusion 96^2 with `b = 1`); else the round's
    own stop stands (`FLOOR`, decided by the driver). The restart is computed
    every round and selected where it is taken: no conditional."""
    st = steps.stepped(lambda st: st.go, functools.partial(_cycle, ctx=ctx), st)
    own = st.status == code(Status.CONVERGED)
    with jax.named_scope("solvax.idrs.restart"):
        r = tree.sub(b, ctx.A(st.x))
        f, (rr,) = ctx.ip.project_many(ctx.P, [r], [(r, r)])
    rr = jnp.real(rr)
    again = own & (rr > ctx.tol2) & (rr < 0.25 * st.start) & (st.k < ctx.max_steps)
    fresh = _restarted(st, st.x, r, f[0].astype(st.f.dtype), ctx.s, st.f.dtype)
    return tree.where(again, fresh._replace(start=rr), st)


IDRS = driver.register(contract.Method("idrs", _run))
IDRS = driver.register(contract.Method("idrs", _run))


def _seed_of(key) -> tuple:
    """The key's data as a static tuple of ints (the shadow space is a
    constant of the solve, like `s`)."""
    if isinstance(key, int | np.integer) and not isinstance(key, bool):
        return ("seed", int(key))
    if isinstance(key, jax.core.Tracer):
        raise TypeError("`key` must be concrete (an int seed or a key made outside `jit`): it "
                        "fixes the shadow space, a constant of the solve like `s`.")
    try:
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        data = np.asarray(key)
    except (AttributeError, TypeError) as e:
        raise TypeError(f"`key` must be an int seed or a JAX PRNG key; got {key!r}.") from e
    if data.dtype != np.uint32 or data.ndim != 1:
        raise TypeError(f"`key` must be an int seed or a single JAX PRNG key; got {key!r}.")
    return ("data", *(int(v) for v in data))


@documented
def idrs(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    s: int = 4,
    key: Any = 0,
    angle: float = 0.0,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    rtol: float | None = None,
    atol: float = 0.0,
    max_steps: int | None = None,
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
) -> Solution:
    """IDR(s) with biorthogonalization for a general (nonsymmetric) `A`,
    right-preconditioned.

    Induced dimension reduction (van Gijzen & Sonneveld 2011): residuals are
    forced into nested spaces `G_j` that shrink by the orthogonal complement
    of an `s`-dimensional *shadow space* `P` every `s + 1` matvecs. Each step
    adds one column `G_k = A U_k`, made biorthogonal to `P` (the small matrix
    `P^H G` stays lower triangular), and each cycle ends with a
    minimal-residual step `x += omega M r`. In exact arithmetic it needs at
    most `n + n / s` matvecs; in practice about as few as GMRES without its
    growing basis (memory: `2 s + 2` vectors).

    Communication: **one synchronization per matvec**: a step's `s` products
    `P^H G_k` and the check of its residual `<r, r>` are one reduction; the
    cycle's last step takes `P^H r`, `P^H t`, `<t, r>`, `<t, t>`, `<r, r>`
    together, which gives the next cycle's `P^H r` without one of its own.

    The shadow space is random: `s` normal vectors per leaf, drawn leaf by
    leaf from `key` with each leaf's shape (under `jit` no leaf is gathered;
    inside `shard_map` each shard draws its own piece, the key folded with
    its index), so a solve is deterministic for a given key and layout.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b`.
        b: right-hand side (array or pytree; each leaf keeps its sharding).
        s: the shadow space's dimension (default 4; larger: fewer matvecs,
            more memory and vector work per matvec).
        key: an int seed or a JAX PRNG key (concrete) for the shadow space.
        angle: the safeguard `kappa` of the cycle's `omega = <t, r> / <t, t>`:
            where `|<t, r>| / (||t|| ||r||) < kappa` it is enlarged by
            `kappa / angle` (van Gijzen & Sonneveld use 0.7, against
            stagnation when `A` has eigenvalues with large imaginary parts).
            Default 0, the plain minimal-residual step of BiCGStab: on
            convection-diffusion 256^2 IDR(4) took 886 matvecs with it and
            1231 with 0.7 (IDR(1) 1034 and 2717).
        x0, rtol, atol, inner_product, axis_name, failed_derivative: the common options.
        precond: `v -> M v`, a right preconditioner (default identity).
        max_steps: matvec limit (default `10 * size(b)`).
        record_history: store the residual norm before every matvec in
            `Solution.history` (length `max_steps + 1`, NaN after the end).

    Returns:
        A `Solution`; `iterations` counts matvecs that updated `x`.
        `converged` is decided on the true residual after the loop. A
        vanishing pivot `P_k^H G_k` or `<t, r>` (zero up to rounding) stops the
        loop as `Status.BREAKDOWN` (retry with another `key` or `s`).

    Raises:
        TypeError, ValueError: at trace time, for mismatched structures,
            shapes or dtypes, negative tolerances, `s < 1`, a negative
            `max_steps` or a traced `key`.

    Differentiable by implicit differentiation: one more IDR(s) solve with the
    transposed operator (`jax.linear_transpose`).

    Reference: M. B. van Gijzen and P. Sonneveld, "Algorithm 913: An elegant
    IDR(s) variant that efficiently exploits biorthogonality properties",
    ACM Trans. Math. Softw. 38 (2011).
    """
    checks.check_int("s", s, 1)
    if isinstance(angle, jax.core.Tracer):
        raise TypeError("`angle` must be a concrete number (it is a constant of the solve).")
    checks.check_tolerance("angle", angle)
    if not angle < 1:
        raise ValueError(f"`angle` must be in [0, 1) (a cosine); got {angle!r}.")
    return driver.solve(IDRS, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, s=int(s), seed=_seed_of(key),
                         angle=float(angle),
                         max_steps=max_steps,
                         record_history=record_history)



# Counts: the scale, the setup's [P^H r, ||r||^2, ||b||^2], one per matvec: s + 1
# per cycle (the loop body is the unrolled cycle), and one per round around the
# cycles (the confirmation's [P^H r, ||r||^2] of the true residual: `per
# iteration` counts it with the cycle's). The tests run s = 2: the code
# paths of the default s = 4 (pinned by the table and
# tests/test_short_recurrence.py) at about half the compile time.
register_solver(idrs, nonsymmetric=True, newton=True,
                variants=(Variant("idrs", {"s": 2}, "idrs", (6, 12, 4)),), rows=(
    Row("IDR(4)", {"s": 4}),
    Row("shard_map: IDR(4) (axis_name)", {"s": 4}, "shard_map"),
    Row("pytree IDR(4), P('i') + P(None,'i') leaves", {}, "pytree"),
))
